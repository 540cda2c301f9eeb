"""fairseq's transformer (``transformer`` and its architectures), decoded with sentences at
different steps in one forward: the interface of a model that mixes steps (see
beamplugin.engine.ensemble), on fairseq's own weights and with fairseq's operations, so each
sentence gets fairseq's scores.

* Each row's self-attention keys and values stay in the incremental state, right-aligned: a row
  that joined later is left-padded, and its padding is masked (its tokens are pad there).
* Positions are per row: pad + the row's own tokens, as fairseq counts them one step at a time.
* The encoder output enters the decoder once per sentence, as every layer's cross-attention
  keys and values, kept in a memory pool of slots (beamplugin.modules.memory_pool); the beam
  rows of a sentence read its slot.
* The decoder's products go through beamplugin.modules.linear, large weights on oneDNN's packed
  copies (as convs2s's): scores equal fairseq's up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.transformer import TransformerModelBase
from fairseq.modules import LearnedPositionalEmbedding, MultiheadAttention
from torch import Tensor, nn

from beamplugin.modules.linear import linear, pack_weight
from beamplugin.modules.memory_pool import Layout, MemoryPool, Pooled

Memory = dict[str, Tensor | None]
Product = Callable[[nn.Linear, Tensor], Tensor]


def mixed_step_view(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """``model`` as a model that mixes steps, if it is a fairseq transformer this path decodes
    exactly; else None and why not."""
    if not isinstance(model, TransformerModelBase):
        return None, None
    reason = _unsupported(model)
    if reason is not None:
        return None, f"fairseq transformer with {reason}"
    return MixedStepTransformer(model), None


def _unsupported(model: TransformerModelBase) -> str | None:
    decoder = model.decoder
    if decoder.adaptive_softmax is not None:
        return "an adaptive softmax"
    if decoder.cross_self_attention:
        return "cross self-attention"
    for layer in decoder.layers:
        if layer.encoder_attn is None:
            return "a decoder layer without encoder attention"
        if any(
            getattr(layer, name, None) is not None
            for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid")
        ):
            return "NormFormer layers"
        for attention in (layer.self_attn, layer.encoder_attn):
            if attention.bias_k is not None or attention.add_zero_attn:
                return "attention bias_kv or zero attention"
    return None


class MixedStepTransformer(nn.Module):
    """A fairseq transformer seen as a model that mixes steps; its weights are the model's."""

    def __init__(self, model: TransformerModelBase) -> None:
        super().__init__()
        self.model = model
        self.encoder = PooledTransformerEncoder(model.encoder, model.decoder)
        self.decoder = MixedStepTransformerDecoder(model.decoder)

    def max_decoder_positions(self) -> int:
        return self.model.max_decoder_positions()

    def get_normalized_probs(
        self, net_output: tuple[Tensor, Any], log_probs: bool, sample: Any = None
    ) -> Tensor:
        return self.model.get_normalized_probs(net_output, log_probs, sample)


class PooledTransformerEncoder(nn.Module):
    """fairseq's encoder, whose output also carries every decoder layer's cross-attention keys
    and values per sentence (``attention_memory``), for a memory pool."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.cross_attentions = nn.ModuleList(layer.encoder_attn for layer in decoder.layers)
        layers = range(len(decoder.layers))
        self.layout: Layout = {"bias": Pooled(width_dim=3, padding=-math.inf)}
        for layer in layers:
            self.layout[f"keys{layer}"] = Pooled(width_dim=3, padding=0.0)
            self.layout[f"values{layer}"] = Pooled(width_dim=2, padding=0.0)

    def max_positions(self) -> int:
        return self.encoder.max_positions()

    def forward_torchscript(self, net_input: dict[str, Tensor]) -> dict[str, Any]:
        out = self.encoder.forward_torchscript(net_input)
        out["attention_memory"] = self.attention_memory(out)
        return out

    def attention_memory(self, encoder_out: dict[str, Any]) -> Memory:
        """keys ``[sentences, heads, head_dim, src]``, values ``[sentences, heads, src,
        head_dim]`` per layer (fairseq's projections of the encoder output), and the bias of
        the padding, ``[sentences, 1, 1, src]``: 0, -inf at padding."""
        states = encoder_out["encoder_out"][0]  # src x sentences x embed
        src, sentences, _ = states.shape
        masks = encoder_out["encoder_padding_mask"]
        mask = masks[0] if masks else states.new_zeros(sentences, src, dtype=torch.bool)
        memory: Memory = {
            "bias": states.new_zeros(sentences, 1, 1, src).masked_fill_(
                mask.view(sentences, 1, 1, src), -math.inf
            )
        }
        for layer, attention in enumerate(self.cross_attentions):
            heads, head_dim = attention.num_heads, attention.head_dim
            keys = attention.k_proj(states).view(src, sentences, heads, head_dim)
            values = attention.v_proj(states).view(src, sentences, heads, head_dim)
            memory[f"keys{layer}"] = keys.permute(1, 2, 3, 0).contiguous()
            memory[f"values{layer}"] = values.permute(1, 2, 0, 3).contiguous()
        return memory

    def memory_pool(self) -> MemoryPool:
        return MemoryPool(self.layout)


class MixedStepTransformerDecoder(nn.Module):
    """fairseq's transformer decoder for rows at different steps, one step at a time."""

    decodes_mixed_steps = True
    reads_encoder_out_per_sentence = True

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.pad = decoder.padding_idx
        self.alignment_layer = len(decoder.layers) - 1
        self.product = PackedProducts()

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: dict[str, Any],
        incremental_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Any]]:
        """The next token's logits ``[rows, 1, vocab]`` of every row of ``prev_output_tokens``
        (``[rows, steps + 1]``, right-aligned, pad before a row's own tokens), and the last
        layer's cross-attention averaged over heads (``{"attn": [[rows, 1, src]]}``)."""
        d = self.decoder
        tokens = prev_output_tokens
        x = d.embed_scale * d.embed_tokens(tokens[:, -1:])
        if d.quant_noise is not None:
            x = d.quant_noise(x)
        if d.project_in_dim is not None:
            x = d.project_in_dim(x)
        if d.embed_positions is not None:
            x += self._positions(tokens)
        if d.layernorm_embedding is not None:
            x = d.layernorm_embedding(x)
        x = x.transpose(0, 1)  # 1 x rows x embed, as fairseq's layers take it
        history_mask = tokens.eq(self.pad)  # masked whether or not any is: no host sync
        groups = encoder_out["attention_groups"]
        attn = None
        for index, layer in enumerate(d.layers):
            need_attn = index == self.alignment_layer
            x, layer_attn = self._layer(
                index, layer, x, groups, incremental_state, history_mask, need_attn
            )
            if need_attn:
                attn = layer_attn
        if d.layer_norm is not None:
            x = d.layer_norm(x)
        x = x.transpose(0, 1)
        if d.project_out_dim is not None:
            x = d.project_out_dim(x)
        return self.product(d.output_projection, x), {"attn": [attn], "inner_states": None}

    def _positions(self, tokens: Tensor) -> Tensor:
        """``[rows, 1, embed]``: each row's position, pad + its own tokens (fairseq's)."""
        embed = self.decoder.embed_positions
        index = tokens.ne(self.pad).sum(1, keepdim=True) + self.pad
        if isinstance(embed, LearnedPositionalEmbedding):
            return F.embedding(index, embed.weight, embed.padding_idx, embed.max_norm,
                               embed.norm_type, embed.scale_grad_by_freq, embed.sparse)
        return embed.weights.index_select(0, index.view(-1)).unsqueeze(1).detach()

    def _layer(
        self,
        index: int,
        layer: nn.Module,
        x: Tensor,
        groups: list[tuple[Memory, int]],
        state: dict[str, Tensor],
        history_mask: Tensor,
        need_attn: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """fairseq's TransformerDecoderLayer (eval mode: no dropout) for one step."""
        residual = x
        if layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        x = _self_attention(layer.self_attn, x, state, f"{index}", history_mask, self.product)
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        residual = x
        if layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        x, attn = _cross_attention(
            layer.encoder_attn, x, groups, index, need_attn, self.product
        )
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        residual = x
        if layer.normalize_before:
            x = layer.final_layer_norm(x)
        x = self.product(layer.fc2, layer.activation_fn(self.product(layer.fc1, x)))
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.final_layer_norm(x)
        return x, attn

    def reorder_incremental_state(
        self, incremental_state: dict[str, Tensor], new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows ``new_order``; the last ``fresh_rows`` of them start afresh (their
        history is padding: masked, so zeros do)."""
        for name, cached in incremental_state.items():
            cached = cached.index_select(0, new_order)
            if fresh_rows:
                cached[-fresh_rows:] = 0
            incremental_state[name] = cached


def _self_attention(
    attention: MultiheadAttention,
    x: Tensor,
    state: dict[str, Tensor],
    name: str,
    history_mask: Tensor,
    product: Product,
) -> Tensor:
    """fairseq's incremental self-attention of ``x`` (``1 x rows x embed``) over each row's
    history; the keys and values of the history are ``state[name + "k"/"v"]``, ``[rows, heads,
    steps, head_dim]``, cut on the left to the rows' history: ``history_mask`` ``[rows,
    steps]``, True at padding."""
    _, rows, embed = x.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    q = product(attention.q_proj, x)
    k = product(attention.k_proj, x)
    v = product(attention.v_proj, x)
    q *= attention.scaling
    q = q.contiguous().view(1, rows * heads, head_dim).transpose(0, 1)
    k = k.contiguous().view(-1, rows * heads, head_dim).transpose(0, 1)
    v = v.contiguous().view(-1, rows * heads, head_dim).transpose(0, 1)
    steps = history_mask.size(1)
    if name + "k" in state:
        prev_k = state[name + "k"].view(rows * heads, -1, head_dim)
        prev_v = state[name + "v"].view(rows * heads, -1, head_dim)
        k = torch.cat([prev_k, k], dim=1)[:, -steps:]
        v = torch.cat([prev_v, v], dim=1)[:, -steps:]
    state[name + "k"] = k.view(rows, heads, -1, head_dim)
    state[name + "v"] = v.view(rows, heads, -1, head_dim)
    weights = torch.bmm(q, k.transpose(1, 2)).view(rows, heads, 1, steps)
    weights = weights.masked_fill(history_mask.view(rows, 1, 1, steps), float("-inf"))
    weights = weights.view(rows * heads, 1, steps)
    probs = utils.softmax(weights, dim=-1).type_as(weights)
    out = torch.bmm(probs, v).transpose(0, 1).contiguous().view(1, rows, embed)
    return product(attention.out_proj, out)


def _cross_attention(
    attention: MultiheadAttention,
    x: Tensor,
    groups: list[tuple[Memory, int]],
    layer: int,
    need_weights: bool,
    product: Product,
) -> tuple[Tensor, Tensor | None]:
    """fairseq's encoder-decoder attention of ``x`` (``1 x rows x embed``): each group of rows
    (its sentences' memory, its rows, sentence-major) reads its sentences' keys and values.
    The weights, averaged over heads, come back ``[rows, 1, src]``, groups left-padded to the
    widest."""
    _, rows, embed = x.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    q = product(attention.q_proj, x)
    q *= attention.scaling
    q = q.view(rows, heads, head_dim)
    context = q.new_empty(rows, heads, head_dim)
    weights, first = [], 0
    for memory, group_rows in groups:
        keys, values = memory[f"keys{layer}"], memory[f"values{layer}"]
        sentences, width = keys.size(0), keys.size(3)
        each = group_rows // sentences
        query = q[first : first + group_rows].view(sentences, each, heads, head_dim)
        query = query.transpose(1, 2).reshape(sentences * heads, each, head_dim)
        scores = torch.bmm(query, keys.view(sentences * heads, head_dim, width))
        scores = scores.view(sentences, heads, each, width) + memory["bias"]
        probs_float = utils.softmax(scores, dim=-1)
        probs = probs_float.type_as(scores).view(sentences * heads, each, width)
        out = torch.bmm(probs, values.view(sentences * heads, width, head_dim))
        context[first : first + group_rows] = (
            out.view(sentences, heads, each, head_dim).transpose(1, 2).reshape(-1, heads, head_dim)
        )
        if need_weights:
            weights.append(probs_float.mean(dim=1).reshape(group_rows, 1, width))
        first += group_rows
    out = product(attention.out_proj, context.view(1, rows, embed))
    if not need_weights:
        return out, None
    widest = max(w.size(-1) for w in weights)
    return out, torch.cat([F.pad(w, (widest - w.size(-1), 0)) for w in weights]).to(x)


class PackedProducts:
    """fairseq's ``nn.Linear`` layers computed with beamplugin.modules.linear: a large weight's
    oneDNN packing is kept while the weight is unchanged (its storage and version)."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[tuple[int, int, torch.dtype], Tensor | None]] = {}

    def __call__(self, module: nn.Linear, x: Tensor) -> Tensor:
        return linear(x, module.weight, module.bias, lambda: self._packing(module.weight))

    def _packing(self, weight: Tensor) -> Tensor | None:
        key = (weight._version, weight.data_ptr(), weight.dtype)
        kept = self._packed.get(id(weight))
        if kept is None or kept[0] != key:
            kept = self._packed[id(weight)] = (key, pack_weight(weight))
        return kept[1]

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
from fairseq.models.transformer import TransformerModelBase
from fairseq.modules import LearnedPositionalEmbedding
from torch import Tensor, nn

from beamplugin.models.transformer_weights import DecoderWeights, LayerWeights
from beamplugin.modules.memory_pool import Layout, MemoryPool, Pooled, lane_width

Memory = dict[str, Tensor | None]


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
        first, own = decoder.layers[0].self_attn, layer.self_attn
        if (own.num_heads, own.head_dim) != (first.num_heads, first.head_dim):
            return "self-attention of different shapes in different layers"
    return None


class MixedStepTransformer(nn.Module):
    """A fairseq transformer seen as a model that mixes steps; its weights are the model's."""

    def __init__(self, model: TransformerModelBase) -> None:
        super().__init__()
        self.model = model
        weights = DecoderWeights(model.decoder)
        self.encoder = PooledTransformerEncoder(model.encoder, model.decoder, weights)
        self.decoder = MixedStepTransformerDecoder(model.decoder, weights)

    def max_decoder_positions(self) -> int:
        return self.model.max_decoder_positions()

    def get_normalized_probs(
        self, net_output: tuple[Tensor, Any], log_probs: bool, sample: Any = None
    ) -> Tensor:
        return self.model.get_normalized_probs(net_output, log_probs, sample)


class PooledTransformerEncoder(nn.Module):
    """fairseq's encoder, whose output also carries every decoder layer's cross-attention keys
    and values per sentence (``attention_memory``), for a memory pool. Each forward checks the
    decoder's prepared weights (:meth:`DecoderWeights.current`), so that steps need not."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, weights: DecoderWeights) -> None:
        super().__init__()
        self.encoder = encoder
        self.cross_attentions = nn.ModuleList(layer.encoder_attn for layer in decoder.layers)
        self.weights = weights
        self.layout: Layout = {"bias": Pooled(width_dim=3, padding=-math.inf)}
        for layer in range(len(decoder.layers)):
            self.layout[f"keys{layer}"] = Pooled(width_dim=3, padding=0.0)
            self.layout[f"values{layer}"] = Pooled(width_dim=2, padding=0.0)

    def max_positions(self) -> int:
        return self.encoder.max_positions()

    def forward_torchscript(self, net_input: dict[str, Tensor]) -> dict[str, Any]:
        """fairseq's encoder output and the attention memory, the sources left-padded to a
        multiple of the vector lanes (beamplugin.modules.memory_pool: the encoder's attention
        then gives each sentence the same bits alone or batched)."""
        self.weights.current()
        tokens = net_input["src_tokens"]
        width = tokens.size(1)
        if width != lane_width(width):
            tokens = F.pad(tokens, (lane_width(width) - width, 0), value=self.encoder.padding_idx)
            net_input = {**net_input, "src_tokens": tokens}
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
    """fairseq's transformer decoder (eval mode: no dropout) for rows at different steps, one
    step at a time, on the prepared weights of :class:`DecoderWeights`.

    The incremental state holds every layer's self-attention keys and values in one tensor,
    ``history`` ``[2 x layers, rows, heads, width, head_dim]`` (keys of layer ``l`` at ``2l``,
    values at ``2l + 1``): each row's own steps last, the very last column this step's, the
    width a multiple of the vector lanes (as the memory pool's, for bit-identical results alone
    or batched), the columns before the longest history zeros. A reorder is only noted; the
    next step gathers the rows it keeps into a new history, one copy for all layers (rows of
    sentences that join are gathered from any row: their history is padding, masked)."""

    decodes_mixed_steps = True
    reads_encoder_out_per_sentence = True

    def __init__(self, decoder: nn.Module, weights: DecoderWeights) -> None:
        super().__init__()
        self.decoder = decoder
        self.weights = weights
        self.pad = decoder.padding_idx
        self.alignment_layer = len(decoder.layers) - 1
        attention = decoder.layers[0].self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: dict[str, Any],
        incremental_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Any]]:
        """The next token's logits ``[rows, 1, vocab]`` of every row of ``prev_output_tokens``
        (``[rows, steps + 1]``, right-aligned, pad before a row's own tokens), and the last
        layer's cross-attention averaged over heads (``{"attn": [[rows, 1, src]]}``)."""
        d, weights = self.decoder, self.weights
        tokens = prev_output_tokens
        rows, steps = tokens.shape
        x = self._embed(tokens)  # rows x embed
        history = self._history(incremental_state, rows, steps, x)
        width = history.size(3)
        # -inf before each row's own steps (masked whether or not any is padding: no host sync)
        own_bias = x.new_full((rows, 1, 1, width), -math.inf)
        own_bias[:, :, :, width - steps :].masked_fill_(
            tokens.ne(self.pad).view(rows, 1, 1, steps), 0.0
        )
        own_bias = own_bias.expand(rows, self.heads, 1, width).reshape(-1, 1, width)
        groups = [
            (memory, group_rows, _cross_bias(memory, group_rows, self.heads))
            for memory, group_rows in encoder_out["attention_groups"]
        ]
        attn = None
        for index, (layer, prepared) in enumerate(zip(d.layers, weights.layers, strict=True)):
            need_attn = index == self.alignment_layer
            residual = x
            if layer.normalize_before:
                x = _norm(layer.self_attn_layer_norm, x)
            x = residual + self._self_attention(prepared, x, history, index, own_bias)
            if not layer.normalize_before:
                x = _norm(layer.self_attn_layer_norm, x)
            residual = x
            if layer.normalize_before:
                x = _norm(layer.encoder_attn_layer_norm, x)
            context, layer_attn = _cross_attention(prepared, x, groups, index, need_attn)
            x = residual + context
            if need_attn:
                attn = layer_attn
            if not layer.normalize_before:
                x = _norm(layer.encoder_attn_layer_norm, x)
            residual = x
            if layer.normalize_before:
                x = _norm(layer.final_layer_norm, x)
            x = residual + prepared.fc2(_activation(layer.activation_fn, prepared.fc1(x)))
            if not layer.normalize_before:
                x = _norm(layer.final_layer_norm, x)
        if d.layer_norm is not None:
            x = _norm(d.layer_norm, x)
        if d.project_out_dim is not None:
            x = d.project_out_dim(x)
        logits = weights.output(x)
        return logits.unsqueeze(1), {"attn": [attn], "inner_states": None}

    def _embed(self, tokens: Tensor) -> Tensor:
        """fairseq's embedding of each row's last token at its own position: ``[rows, embed]``."""
        d = self.decoder
        x = d.embed_scale * d.embed_tokens(tokens[:, -1])
        if d.quant_noise is not None:
            x = d.quant_noise(x)
        if d.project_in_dim is not None:
            x = d.project_in_dim(x)
        if d.embed_positions is not None:
            x += self._positions(tokens)
        if d.layernorm_embedding is not None:
            x = d.layernorm_embedding(x)
        return x

    def _positions(self, tokens: Tensor) -> Tensor:
        """``[rows, embed]``: each row's position, pad + its own tokens (fairseq's)."""
        embed = self.decoder.embed_positions
        index = tokens.ne(self.pad).sum(1) + self.pad
        if isinstance(embed, LearnedPositionalEmbedding):
            return F.embedding(index, embed.weight, embed.padding_idx, embed.max_norm,
                               embed.norm_type, embed.scale_grad_by_freq, embed.sparse)
        return embed.weights.index_select(0, index).detach()

    def _history(self, state: dict[str, Tensor], rows: int, steps: int, like: Tensor) -> Tensor:
        """This step's self-attention history: the last step's ``steps - 1`` columns, its rows
        gathered in the order noted by the reorder, then a free column, zeros before."""
        old, order = state.get("history"), state.pop("order", None)
        layers, width = len(self.decoder.layers), lane_width(steps)
        history = like.new_empty(2 * layers, rows, self.heads, width, self.head_dim)
        if width > steps:  # masked, but never garbage: 0 x NaN would not be 0
            history[:, :, :, : width - steps].zero_()
        if old is not None and steps > 1:
            window = old[:, :, :, old.size(3) - steps + 1 :]
            kept = history[:, :, :, width - steps : -1]
            if order is None:
                kept.copy_(window)
            else:
                torch.index_select(window, 1, order, out=kept)
        state["history"] = history
        return history

    def _self_attention(
        self, prepared: LayerWeights, x: Tensor, history: Tensor, layer: int, bias: Tensor
    ) -> Tensor:
        """fairseq's incremental self-attention of ``x`` ``[rows, embed]`` over each row's
        history (its keys and values at ``history[2 * layer]``, ``[2 * layer + 1]``; this
        step's written in the last column); ``bias`` ``[rows x heads, 1, width]``: -inf at
        padding."""
        rows, embed = x.shape
        heads, head_dim = self.heads, self.head_dim
        qkv = prepared.self_qkv(x)
        width = history.size(3)
        history[2 * layer : 2 * layer + 2, :, :, -1] = qkv[:, embed:].view(
            rows, 2, heads, head_dim
        ).transpose(0, 1)
        keys = history[2 * layer].view(rows * heads, width, head_dim)
        values = history[2 * layer + 1].view(rows * heads, width, head_dim)
        query = qkv[:, :embed].reshape(rows * heads, 1, head_dim)
        scores = torch.baddbmm(bias, query, keys.transpose(1, 2))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        return prepared.self_out(torch.bmm(probs, values).view(rows, embed))

    def reorder_incremental_state(
        self, incremental_state: dict[str, Tensor], new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows ``new_order`` (noted: the next step gathers them); the last
        ``fresh_rows`` of them start afresh, which needs nothing (their history is padding,
        masked)."""
        noted = incremental_state.get("order")
        incremental_state["order"] = (
            new_order if noted is None else noted.index_select(0, new_order)
        )


def _norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _activation(activation: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return x.relu_() if activation is F.relu else activation(x)


def _cross_bias(memory: Memory, rows: int, heads: int) -> Tensor:
    """The padding bias of a group's sources for its rows and heads: ``[sentences x heads, rows
    of each, src]``."""
    bias = memory["bias"]
    sentences, width = bias.size(0), bias.size(3)
    each = rows // sentences
    return bias.expand(sentences, heads, each, width).reshape(-1, each, width)


def _cross_attention(
    prepared: LayerWeights,
    x: Tensor,
    groups: list[tuple[Memory, int, Tensor]],
    layer: int,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """fairseq's encoder-decoder attention of ``x`` ``[rows, embed]``: each group of rows (its
    sentences' memory, its rows, sentence-major, and their padding bias) reads its sentences'
    keys and values. The weights, averaged over heads, come back ``[rows, 1, src]``, groups
    left-padded to the widest."""
    rows, embed = x.shape
    q = prepared.cross_query(x)
    contexts, weights, first = [], [], 0
    for memory, group_rows, bias in groups:
        keys, values = memory[f"keys{layer}"], memory[f"values{layer}"]
        sentences, heads, head_dim, width = keys.shape
        each = group_rows // sentences
        query = q[first : first + group_rows].view(sentences, each, heads, head_dim)
        query = query.transpose(1, 2).reshape(sentences * heads, each, head_dim)
        scores = torch.baddbmm(bias, query, keys.view(sentences * heads, head_dim, width))
        probs_float = F.softmax(scores, dim=-1, dtype=torch.float32)
        probs = probs_float.type_as(scores)
        out = torch.bmm(probs, values.view(sentences * heads, width, head_dim))
        out = out.view(sentences, heads, each, head_dim).transpose(1, 2)
        contexts.append(out.reshape(group_rows, embed))
        if need_weights:
            per_head = probs_float.view(sentences, heads, each, width)
            weights.append(per_head.mean(dim=1).reshape(group_rows, 1, width))
        first += group_rows
    context = contexts[0] if len(contexts) == 1 else torch.cat(contexts)
    out = prepared.cross_out(context)
    if not need_weights:
        return out, None
    widest = max(w.size(-1) for w in weights)
    return out, torch.cat([F.pad(w, (widest - w.size(-1), 0)) for w in weights]).to(x)

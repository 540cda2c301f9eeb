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
* The decoder's products go through beamplugin.modules.prepared_linear, on packed weights (as
  convs2s's), and a step's attention in float32 on the CPU through our kernel
  (beamplugin.kernels.float_attention), one call per layer for each attention: scores equal
  fairseq's up to float rounding.
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

from beamplugin.kernels import float_attention, transformer_layers
from beamplugin.models.normalization import plain_softmax
from beamplugin.models.transformer_weights import LayerWeights, TransformerWeights
from beamplugin.modules.memory_pool import Layout, MemoryPool, Pooled, lane_width, least_width
from beamplugin.modules.output_columns import OutputColumns
from beamplugin.modules.prepared_linear import PreparedLinear
from beamplugin.modules.self_attention_history import SelfAttentionHistory, Window
from beamplugin.modules.width_groups import width_groups
from beamplugin.runtime import pages

Memory = dict[str, Tensor | None]
_FLOAT32 = torch.empty(0)  # the dtype and device of a step's logits on our kernels


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
        first = decoder.layers[0]
        for name in ("self_attn", "encoder_attn"):
            own, firsts = getattr(layer, name), getattr(first, name)
            if (own.num_heads, own.head_dim) != (firsts.num_heads, firsts.head_dim):
                return "attention of different shapes in different layers"
    for layer in model.encoder.layers:
        if layer.self_attn.bias_k is not None or layer.self_attn.add_zero_attn:
            return "attention bias_kv or zero attention"
    return None


class MixedStepTransformer(nn.Module):
    """A fairseq transformer seen as a model that mixes steps; its weights are the model's."""

    def __init__(self, model: TransformerModelBase) -> None:
        super().__init__()
        self.model = model
        weights = TransformerWeights(model)
        self.encoder = PooledTransformerEncoder(model.encoder, model.decoder, weights)
        self.decoder = MixedStepTransformerDecoder(model.decoder, weights)
        self.plain_softmax = plain_softmax(model)

    def max_decoder_positions(self) -> int:
        return self.model.max_decoder_positions()

    def get_normalized_probs(
        self, net_output: tuple[Tensor, Any], log_probs: bool, sample: Any = None
    ) -> Tensor:
        if self.plain_softmax:  # fairseq's operation, without its four calls down to it
            softmax = F.log_softmax if log_probs else F.softmax
            return softmax(net_output[0], dim=-1, dtype=torch.float32)
        return self.model.get_normalized_probs(net_output, log_probs, sample)


class PooledTransformerEncoder(nn.Module):
    """fairseq's encoder on the prepared weights of :class:`TransformerWeights` (made current
    at each forward, so that steps need not check them), whose output also carries every
    decoder layer's cross-attention keys and values per sentence (``attention_memory``), for a
    memory pool."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, weights: TransformerWeights) -> None:
        super().__init__()
        self.encoder = encoder
        self.weights = weights
        self.pad = encoder.padding_idx
        self.layers = len(decoder.layers)
        attention = decoder.layers[0].encoder_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.layout: Layout = {"bias": Pooled(width_dim=3, padding=-math.inf)}
        for layer in range(self.layers):
            self.layout[f"keys{layer}"] = Pooled(width_dim=3, padding=0.0)
            self.layout[f"values{layer}"] = Pooled(width_dim=2, padding=0.0)

    def max_positions(self) -> int:
        return self.encoder.max_positions()

    def forward_torchscript(self, net_input: dict[str, Tensor]) -> dict[str, Any]:
        """The attention memory of fairseq's encoder output (what the memory pool keeps: see
        :meth:`_attention_memory`), the sources left-padded to a multiple of the vector lanes
        and to the width the memory pool reads at least (beamplugin.modules.memory_pool: each
        sentence then gets the same bits alone or batched; a new batch's memory becomes the
        pool's as it is). Only the attention reads that padding: the products and norms run on the
        sources' own width (zeros, masked, stand for the lanes' keys and values); on our kernels,
        sentences of similar width together, each group on its own widest
        (beamplugin.modules.width_groups)."""
        weights = self.weights.current()
        tokens = net_input["src_tokens"]
        sentences, width = tokens.shape
        src = max(lane_width(width), least_width(self.head_dim))  # as wide as the pool reads
        encoder = self.encoder
        padding = tokens.eq(self.pad)
        x, _ = encoder.forward_embedding(tokens)
        x = x * (1 - padding.unsqueeze(-1).type_as(x))
        padding = F.pad(padding, (src - width, 0), value=True)
        bias = x.new_zeros(sentences, 1, 1, src).masked_fill_(
            padding.view(sentences, 1, 1, src), -math.inf
        )
        keys, values = self._memory_buffers(sentences, src, x)
        in_kernel = weights.encoder_in_kernel
        if in_kernel is None or not float_attention.serves(x, in_kernel.heads, in_kernel.head_dim):
            x = x.reshape(sentences * width, -1)
            for layer, prepared in zip(encoder.layers, weights.encoder_layers, strict=True):
                x = _encoder_layer(layer, prepared, x, bias, sentences)
            self._project(weights, self._final_norm(x), keys, values, None)
            return {"attention_memory": self._attention_memory(keys, values, bias)}
        # the positions from each sentence's first own token on (left-padded: its own)
        spans = width - tokens.ne(self.pad).int().argmax(1)
        for group, group_width in width_groups(spans.tolist()):
            index = torch.tensor(group, device=x.device)
            part = x.index_select(0, index)[:, width - group_width :].reshape(-1, x.size(2))
            part = in_kernel(part.contiguous(), len(group), bias[index, ..., src - group_width :])
            self._project(weights, self._final_norm(part), keys, values, index)
        return {"attention_memory": self._attention_memory(keys, values, bias)}

    def _final_norm(self, x: Tensor) -> Tensor:
        norm = self.encoder.layer_norm
        return x if norm is None else _norm(norm, x)

    def _memory_buffers(self, sentences: int, src: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Zeroed keys ``[layers, sentences, heads, head_dim, src]`` and values ``[layers,
        sentences, heads, src, head_dim]``: mappings of their own, given back whole once the
        pool has copied them (from the heap they would leave holes that the heap keeps)."""
        shape = (self.layers, sentences, self.heads)
        return (
            pages.zeros((*shape, self.head_dim, src), like),
            pages.zeros((*shape, src, self.head_dim), like),
        )

    def _project(
        self, weights: TransformerWeights, x: Tensor, keys: Tensor, values: Tensor,
        index: Tensor | None,
    ) -> None:  # fmt: skip
        """fairseq's projections of the encoder output ``x`` ``[sentences x width, embed]`` of
        the sentences ``index`` (None: all), one product for all layers, into the last
        ``width`` source positions of their ``keys`` and ``values``."""
        sentences = keys.size(1) if index is None else index.numel()
        width, layers, src = x.size(0) // sentences, self.layers, keys.size(4)
        projected = weights.memory(x).view(sentences, width, layers, 2, self.heads, self.head_dim)
        own_keys = projected[:, :, :, 0].permute(2, 0, 3, 4, 1)
        own_values = projected[:, :, :, 1].permute(2, 0, 3, 1, 4)
        if index is None:
            keys[..., src - width :] = own_keys
            values[:, :, :, src - width :] = own_values
        else:
            keys[..., src - width :].index_copy_(1, index, own_keys)
            values[:, :, :, src - width :].index_copy_(1, index, own_values)

    def _attention_memory(self, keys: Tensor, values: Tensor, bias: Tensor) -> Memory:
        """Every decoder layer's keys and values (see :meth:`_memory_buffers`) with zeros at
        every padding position, the lanes' and a sentence's own, as the memory pool pads (it
        reads a sentence's rows wider than its own width), and the padding ``bias``
        ``[sentences, 1, 1, src]``: 0, -inf at padding."""
        sentences, src = bias.size(0), bias.size(3)
        padding = bias.view(1, sentences, 1, src).isinf()  # the lanes before too: all zeroed
        keys.masked_fill_(padding.unsqueeze(3), 0.0)
        values.masked_fill_(padding.unsqueeze(4), 0.0)
        memory: Memory = {"bias": bias}
        for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
            memory[f"keys{layer}"], memory[f"values{layer}"] = layer_keys, layer_values
        return memory

    def memory_pool(self) -> MemoryPool:
        return MemoryPool(self.layout, self.head_dim, padded=True)


class MixedStepTransformerDecoder(nn.Module):
    """fairseq's transformer decoder (eval mode: no dropout) for rows at different steps, one
    step at a time, on the prepared weights of :class:`TransformerWeights`.

    The incremental state holds every layer's self-attention keys and values
    (beamplugin.modules.self_attention_history), each row's own steps last: the columns before
    them are masked."""

    decodes_mixed_steps = True
    reads_encoder_out_per_sentence = True
    computes_output_columns = True  # a shortlist's columns alone: see forward

    def __init__(self, decoder: nn.Module, weights: TransformerWeights) -> None:
        super().__init__()
        self.decoder = decoder
        self.dictionary = decoder.dictionary  # as every fairseq decoder has it
        self.weights = weights
        self.pad = decoder.padding_idx
        self.alignment_layer = len(decoder.layers) - 1
        attention = decoder.layers[0].self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.history = SelfAttentionHistory(len(decoder.layers), self.heads, self.head_dim)
        layers = range(len(decoder.layers))  # the memory's names of each layer's keys, values
        self.memory_names = [f"keys{i}" for i in layers], [f"values{i}" for i in layers]

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: dict[str, Any],
        incremental_state: dict[str, Any],
        need_attn: bool = True,
        output_columns: OutputColumns | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """The next token's logits ``[rows, 1, vocab]`` of every row of ``prev_output_tokens``
        (``[rows, steps + 1]``, right-aligned, pad before a row's own tokens), and with
        ``need_attn`` the last layer's cross-attention averaged over heads (``{"attn": [[rows,
        1, src]]}``; else ``[None]``). With ``output_columns``, only those columns are
        multiplied where they are few (logits ``[rows, 1, n]``), else every one."""
        d, weights = self.decoder, self.weights
        tokens = prev_output_tokens
        rows, steps = tokens.shape
        output, output_in_kernel = weights.output, None
        vocab = len(d.dictionary)
        if output_columns is not None and output_columns.narrow(vocab):
            output, output_in_kernel = weights.output_columns(output_columns.columns)
        in_kernel = weights.decoder_in_kernel
        if in_kernel is not None and tokens.is_cpu and not torch.is_grad_enabled():
            history = self.history.advance(incremental_state, rows, steps, weights.output.weight)
            width = vocab if output_in_kernel is None else output_columns.columns.numel()
            logits = _kept_logits(incremental_state, rows, width)
            attn = self._step_in_kernel(
                in_kernel, tokens, history, encoder_out, need_attn, output_in_kernel, logits,
                incremental_state,
            )  # fmt: skip
            return logits.unsqueeze(1), {"attn": [attn], "inner_states": None}
        x = self._embed(tokens)  # rows x embed
        history = self.history.advance(incremental_state, rows, steps, x)
        width = history.sources.size(1)
        # -inf before each row's own steps (masked whether or not any is padding: no host sync)
        own_bias = x.new_full((rows, width), -math.inf)
        own_bias[:, width - steps :].masked_fill_(tokens.ne(self.pad), 0.0)
        native = float_attention.serves(x, self.heads, self.head_dim)
        if not native:  # torch's batched products take [rows x heads, 1, width]
            own_bias = own_bias.view(rows, 1, 1, width).expand(rows, self.heads, 1, width)
            own_bias = own_bias.reshape(-1, 1, width)
        x, attn = self._layers(x, history, own_bias, encoder_out, native, need_attn)
        if d.layer_norm is not None:
            x = _norm(d.layer_norm, x)
        if d.project_out_dim is not None:
            x = d.project_out_dim(x)
        return output(x).unsqueeze(1), {"attn": [attn], "inner_states": None}

    def _step_in_kernel(
        self,
        in_kernel: transformer_layers.DecoderStep,
        tokens: Tensor,
        history: Window,
        encoder_out: dict[str, Any],
        need_attn: bool,
        output: transformer_layers.Product | None,
        logits: Tensor,
        state: dict[str, Any],
    ) -> Tensor | None:
        """The step in one call of our kernels (beamplugin.kernels.transformer_layers), its logits
        written into ``logits`` ``[rows, vocab]`` (of ``output``'s columns, if given); if
        ``need_attn``, the alignment layer's cross-attention averaged over heads ``[rows, 1,
        src]``. The C step's table of the memory views is kept in the batch's incremental
        ``state``, so it goes with the batch (the views hold every sentence's memory: 200 MB at
        NLLB-600M size and 64 sentences, alive until the next batch replaced them)."""
        views = encoder_out["attention_groups"]  # the same list while no sentence comes or goes
        cached = state.get("kernel_groups")
        if cached is None or cached[0] is not views:
            keys, values = self.memory_names
            groups = [
                transformer_layers.Group(
                    [memory[name] for name in keys], [memory[name] for name in values],
                    memory["bias"], group_rows,
                )  # fmt: skip
                for memory, group_rows in views
            ]
            cached = state["kernel_groups"] = views, in_kernel.groups(groups)
        alignment_layer = self.alignment_layer if need_attn else None
        attn = in_kernel(
            tokens, history.keys_values, history.sources, cached[1], alignment_layer, output,
            logits,
        )  # fmt: skip
        return None if attn is None else attn.unsqueeze(1)

    def _layers(
        self,
        x: Tensor,
        history: Window,
        own_bias: Tensor,
        encoder_out: dict[str, Any],
        native: bool,
        need_attn: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Every layer one call at a time (our kernels where ``native``, else torch's), and, if
        ``need_attn``, the alignment layer's cross-attention weights averaged over heads."""
        groups = [
            (memory, group_rows, None if native else _cross_bias(memory, group_rows, self.heads))
            for memory, group_rows in encoder_out["attention_groups"]
        ]
        attn = None
        layers = zip(self.decoder.layers, self.weights.decoder_layers, strict=True)
        for index, (layer, prepared) in enumerate(layers):
            alignment = need_attn and index == self.alignment_layer
            x, layer_attn = _decoder_layer(
                layer, prepared, index, x, history, own_bias, groups, alignment
            )
            if alignment:
                attn = layer_attn
        return x, attn

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
            return F.embedding(
                index,
                embed.weight,
                embed.padding_idx,
                embed.max_norm,
                embed.norm_type,
                embed.scale_grad_by_freq,
                embed.sparse,
            )
        return embed.weights.index_select(0, index).detach()

    def reorder_incremental_state(
        self, incremental_state: dict[str, Any], new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows ``new_order``; the last ``fresh_rows`` of them start afresh, which
        needs nothing (their history is padding, masked)."""
        self.history.reorder(incremental_state, new_order)


def _kept_logits(state: dict[str, Any], rows: int, width: int) -> Tensor:
    """Where a step writes its logits ``[rows, width]``: a buffer the incremental state keeps
    from step to step (64 sentences' logits over 256k words are 328 MB, which a new tensor maps
    and faults in again at every step), a mapping of its own, given back with the state (not
    left in the heap for what comes after the batch). The logits, and the log-probs the engine
    makes of them in place, are read within their step."""
    buffer = state.get("logits")
    if buffer is None or buffer.numel() < rows * width:
        buffer = state["logits"] = pages.zeros((rows * width,), _FLOAT32)
    return buffer[: rows * width].view(rows, width)


def _decoder_layer(
    layer: nn.Module,
    prepared: LayerWeights,
    index: int,
    x: Tensor,
    history: Window,
    own_bias: Tensor,
    groups: list[tuple[Memory, int, Tensor | None]],
    need_attn: bool,
) -> tuple[Tensor, Tensor | None]:
    """fairseq's decoder layer ``index`` on ``x`` ``[rows, embed]``, and its cross-attention
    weights if ``need_attn``. ``own_bias`` ``[rows, width]`` and the groups' biases None where
    our attention kernel serves ``x``; else the biases torch's products take."""
    before = layer.normalize_before
    norm = layer.self_attn_layer_norm
    x = _decoder_self_attention(
        prepared, _norm_input(norm, before, x), history, index, own_bias,
        residual=x, post=_post_norm(norm, before), heads=layer.self_attn.num_heads,
    )  # fmt: skip
    norm = layer.encoder_attn_layer_norm
    x, attn = _cross_attention(
        prepared, _norm_input(norm, before, x), groups, index, need_attn,
        residual=x, post=_post_norm(norm, before),
    )  # fmt: skip
    return _feed_forward(layer, prepared, x), attn


def _decoder_self_attention(
    prepared: LayerWeights,
    x: Tensor,
    history: Window,
    layer: int,
    bias: Tensor,
    residual: Tensor,
    post: nn.LayerNorm | None,
    heads: int,
) -> Tensor:
    """``residual`` plus fairseq's incremental self-attention of ``x`` ``[rows, embed]`` over
    each row's ``history`` (its keys and values at ``2 * layer``, ``2 * layer + 1``; this
    step's written in the last column), normed by ``post`` if given; ``bias`` -inf at padding,
    ``[rows, width]`` for our kernel, ``[rows x heads, 1, width]`` for torch's products."""
    rows, embed = x.shape
    head_dim = embed // heads
    qkv = prepared.self_qkv(x)
    if bias.dim() == 2:
        keys, values = history.keys_values[2 * layer], history.keys_values[2 * layer + 1]
        context = float_attention.self_attention(qkv, keys, values, history.sources, bias)
        return prepared.self_out.plus(context, residual, post)
    history.keys_values[2 * layer : 2 * layer + 2, :rows, :, -1] = (
        qkv[:, embed:].view(rows, 2, heads, head_dim).transpose(0, 1)
    )
    keys = history.gathered(2 * layer).reshape(rows * heads, -1, head_dim)
    values = history.gathered(2 * layer + 1).reshape(rows * heads, -1, head_dim)
    query = qkv[:, :embed].reshape(rows * heads, 1, head_dim)
    context, _ = _attend(bias, query, keys.transpose(1, 2), values)
    return prepared.self_out.plus(context.view(rows, embed), residual, post)


def _encoder_layer(
    layer: nn.Module, prepared: LayerWeights, x: Tensor, bias: Tensor, sentences: int
) -> Tensor:
    """fairseq's encoder layer (eval mode) on ``x`` ``[sentences x src, embed]``; ``bias``
    ``[sentences, 1, 1, src]``: -inf at padding."""
    before, norm = layer.normalize_before, layer.self_attn_layer_norm
    out = _encoder_self_attention(
        layer.self_attn, prepared, _norm_input(norm, before, x), bias, sentences,
        residual=x, post=_post_norm(norm, before),
    )  # fmt: skip
    return _feed_forward(layer, prepared, out)


def _norm_input(norm: nn.LayerNorm, before: bool, x: Tensor) -> Tensor:
    """A residual sublayer's input: ``x`` normed first in a pre-norm layer."""
    return _norm(norm, x) if before else x


def _post_norm(norm: nn.LayerNorm, before: bool) -> nn.LayerNorm | None:
    """The norm of a residual sublayer's output (residual added): a post-norm layer's, which its
    last product applies."""
    return None if before else norm


def _feed_forward(layer: nn.Module, prepared: LayerWeights, x: Tensor) -> Tensor:
    """fairseq's feed-forward sublayer, the residual added (and a post-norm applied) inside the
    second product."""
    before, norm = layer.normalize_before, layer.final_layer_norm
    hidden = _hidden(layer.activation_fn, prepared.fc1, _norm_input(norm, before, x))
    return prepared.fc2.plus(hidden, x, _post_norm(norm, before))


def _encoder_self_attention(
    attention: nn.Module,
    prepared: LayerWeights,
    x: Tensor,
    bias: Tensor,
    sentences: int,
    residual: Tensor,
    post: nn.LayerNorm | None,
) -> Tensor:
    """``residual`` plus fairseq's self-attention of every source position (``x`` ``[sentences
    x width, embed]``) over its sentence's unpadded positions, normed by ``post`` if given; the
    attention over ``bias``'s lanes ``[sentences, 1, 1, src]``, zeros before the sources."""
    heads, head_dim = attention.num_heads, attention.head_dim
    tokens, embed = x.shape
    width, src = tokens // sentences, bias.size(3)
    qkv = prepared.self_qkv(x).view(sentences, width, 3, heads, head_dim)
    if float_attention.serves(x, heads, head_dim):  # each row and head alone: no bit changes
        keys = qkv[:, :, 1].permute(0, 2, 3, 1).contiguous()
        values = qkv[:, :, 2].transpose(1, 2).contiguous()
        context = torch.empty_like(x)
        float_attention.cross_attention(
            qkv[:, :, 0].reshape(tokens, embed), keys, values, bias[..., src - width :], context,
            need_weights=False,
        )  # fmt: skip
        return prepared.self_out.plus(context, residual, post)
    qkv = _left_padded(qkv.view(sentences, width, 3 * embed), src)
    qkv = qkv.view(sentences, src, 3, heads, head_dim)
    query = qkv[:, :, 0].transpose(1, 2).reshape(sentences * heads, src, head_dim)
    keys = qkv[:, :, 1].permute(0, 2, 3, 1).reshape(sentences * heads, head_dim, src)
    values = qkv[:, :, 2].transpose(1, 2).reshape(sentences * heads, src, head_dim)
    pad = bias.expand(sentences, heads, 1, src).reshape(sentences * heads, 1, src)
    context, _ = _attend(pad, query, keys, values)
    context = context.view(sentences, heads, src, head_dim)[:, :, src - width :].transpose(1, 2)
    return prepared.self_out.plus(context.reshape(tokens, embed), residual, post)


def _left_padded(x: Tensor, src: int) -> Tensor:
    """``x`` ``[sentences, width, ...]`` with zeros before, ``src`` wide."""
    width = x.size(1)
    if width == src:
        return x
    padded = x.new_zeros((x.size(0), src, *x.shape[2:]))
    padded[:, src - width :] = x
    return padded


def _attend(bias: Tensor, query: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """fairseq's attention (queries scaled already): ``softmax(bias + query @ keys) @ values``
    over batched heads, ``keys`` ``[batch, head_dim, width]``; also the float32 weights."""
    scores = torch.baddbmm(bias, query, keys)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.bmm(probs.type_as(scores), values), probs


def _norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _hidden(activation: Callable[[Tensor], Tensor], fc1: PreparedLinear, x: Tensor) -> Tensor:
    """The feed-forward's hidden layer, a relu fused into its product."""
    return fc1.relu(x) if activation is F.relu else activation(fc1(x))


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
    groups: list[tuple[Memory, int, Tensor | None]],
    layer: int,
    need_weights: bool,
    residual: Tensor,
    post: nn.LayerNorm | None,
) -> tuple[Tensor, Tensor | None]:
    """``residual`` plus fairseq's encoder-decoder attention of ``x`` ``[rows, embed]``, normed
    by ``post`` if given: each group of rows (its sentences' memory, its rows, sentence-major,
    and their padding bias for torch's products, None for our kernel) reads its sentences' keys
    and values. The weights, averaged over heads, come back ``[rows, 1, src]``, groups
    left-padded to the widest."""
    q = prepared.cross_query(x)
    weights: list[Tensor] = []
    in_kernel = groups[0][2] is None
    attend = _cross_attention_in_kernel if in_kernel else _cross_attention_in_torch
    context = attend(q, groups, layer, need_weights, weights)
    out = prepared.cross_out.plus(context, residual, post)
    if not need_weights:
        return out, None
    widest = max(w.size(-1) for w in weights)
    return out, torch.cat([F.pad(w, (widest - w.size(-1), 0)) for w in weights]).to(x)


def _cross_attention_in_kernel(
    q: Tensor,
    groups: list[tuple[Memory, int, Tensor | None]],
    layer: int,
    need_weights: bool,
    weights: list[Tensor],
) -> Tensor:
    """:func:`_cross_attention`'s contexts ``[rows, embed]`` by our kernel, each group's
    written straight into its rows; its weights averaged over heads appended to ``weights`` if
    ``need_weights``."""
    context, first = torch.empty_like(q), 0
    for memory, group_rows, _ in groups:
        keys, values = memory[f"keys{layer}"], memory[f"values{layer}"]
        last = first + group_rows
        mean = float_attention.cross_attention(
            q[first:last], keys, values, memory["bias"], context[first:last], need_weights
        )
        if mean is not None:
            weights.append(mean.unsqueeze(1))
        first = last
    return context


def _cross_attention_in_torch(
    q: Tensor,
    groups: list[tuple[Memory, int, Tensor | None]],
    layer: int,
    need_weights: bool,
    weights: list[Tensor],
) -> Tensor:
    """:func:`_cross_attention`'s contexts ``[rows, embed]`` by torch's batched products; each
    group's weights averaged over heads appended to ``weights`` if ``need_weights``."""
    embed = q.size(1)
    contexts, first = [], 0
    for memory, group_rows, bias in groups:
        keys, values = memory[f"keys{layer}"], memory[f"values{layer}"]
        sentences, heads, head_dim, width = keys.shape
        each = group_rows // sentences
        query = q[first : first + group_rows].view(sentences, each, heads, head_dim)
        query = query.transpose(1, 2).reshape(sentences * heads, each, head_dim)
        out, probs_float = _attend(
            bias,
            query,
            keys.view(sentences * heads, head_dim, width),
            values.view(sentences * heads, width, head_dim),
        )
        out = out.view(sentences, heads, each, head_dim).transpose(1, 2)
        contexts.append(out.reshape(group_rows, embed))
        if need_weights:
            per_head = probs_float.view(sentences, heads, each, width)
            weights.append(per_head.mean(dim=1).reshape(group_rows, 1, width))
        first += group_rows
    return contexts[0] if len(contexts) == 1 else torch.cat(contexts)

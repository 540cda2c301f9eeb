"""fairseq's transformer decoder on fixed-capacity rows: the model half of the device step
(beamplugin.engine.device_engine).

A sentence holds the same ``beam`` rows from its admission to its end. Every row keeps its
self-attention keys and values in one buffer ``[2 x layers, rows, heads, columns, head_dim]``,
left-aligned (column ``t``: the key of the row's token ``t``, BOS at 0), and every sentence slot
its cross-attention keys and values ``[2 x layers, slots, heads, sources, head_dim]``, its source
from column 0 on. A step runs the first ``rows`` rows over the first ``columns`` and ``sources``
columns (the bucket), reads only static tensors and writes in place: no host synchronisation and
no shape that depends on data, so that a CUDA graph can replay it.

Left alignment keeps a row's own columns where they are whatever the bucket's width, and the
columns after them are masked (their weights are exactly 0): a wider bucket only adds zeros
after the row's own terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fairseq.modules import LearnedPositionalEmbedding
from torch import Tensor

from beamplugin.models.mixed_step_transformer import (
    MixedStepTransformer,
    _feed_forward,
    _norm,
    _norm_input,
    _post_norm,
)
from beamplugin.models.transformer_weights import LayerWeights
from beamplugin.modules.row_attention import attend, own_columns


def serves(model: object) -> bool:
    """Whether this path decodes ``model`` (one of an ensemble's models, as the engine sees it:
    fairseq's transformer through its mixed-step view)."""
    return isinstance(model, MixedStepTransformer)


class FixedRowsTransformer:
    """The decoder state of ``slots`` sentences of ``beam`` rows for ``view``'s transformer:
    room for ``columns`` tokens a row and ``sources`` source positions a sentence."""

    def __init__(
        self, view: MixedStepTransformer, slots: int, beam: int, columns: int, sources: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        decoder = view.decoder
        self.view, self.beam = view, beam
        self.layers = len(decoder.decoder.layers)
        self.heads, self.head_dim = decoder.heads, decoder.head_dim
        self.slots, self.columns, self.sources = slots, columns, sources
        rows = slots * beam
        shape = (2 * self.layers, rows, self.heads, columns, self.head_dim)
        self.history = torch.zeros(shape, dtype=dtype, device=device)
        shape = (2 * self.layers, slots, self.heads, sources, self.head_dim)
        self.memory = torch.zeros(shape, dtype=dtype, device=device)
        self.source_mask = torch.zeros((slots, sources), dtype=torch.bool, device=device)
        embed = decoder.decoder.embed_positions
        # fairseq's sinusoids are a plain attribute it moves at each forward: moved here once
        self.sinusoids = (
            None if embed is None or isinstance(embed, LearnedPositionalEmbedding)
            else embed.weights.to(device=device, dtype=dtype)
        )  # fmt: skip

    def grown(self, slots: int, columns: int, sources: int) -> FixedRowsTransformer:
        """A state with room for more, holding this one's contents at the same places."""
        new = FixedRowsTransformer(
            self.view, slots, self.beam, columns, sources, self.history.dtype, self.history.device
        )
        rows = self.slots * self.beam
        new.history[:, :rows, :, : self.columns] = self.history
        new.memory[:, : self.slots, :, : self.sources] = self.memory
        new.source_mask[: self.slots, : self.sources] = self.source_mask
        return new

    # ---- between steps ---------------------------------------------------------------------

    def write_memory(self, slots: Tensor, encoder_out: dict, first: int, count: int) -> None:
        """Put the cross-attention memory of rows ``first .. first + count`` of ``encoder_out``
        (the pooled encoder's output: sources left-padded) into ``slots``, each source from
        column 0 on."""
        memory = encoder_out["attention_memory"]
        # the last columns: a source's own (padding for the vector lanes comes before them)
        width = min(memory["bias"].size(3), self.sources)
        cut = slice(first, first + count)
        taken, mask = own_columns(memory["bias"][cut, 0, 0, -width:].isfinite())
        keys = torch.stack([memory[f"keys{i}"][cut, ..., -width:] for i in range(self.layers)])
        values = torch.stack([memory[f"values{i}"][cut, :, -width:] for i in range(self.layers)])
        keys = keys.transpose(3, 4)  # layers, sentences, heads, width, head_dim
        index = taken.view(1, count, 1, width, 1).expand_as(keys)
        both = torch.stack([keys.gather(3, index), values.gather(3, index)], 1)
        both = both.flatten(0, 1).to(self.memory.dtype)  # keys of layer l at 2l, values at 2l + 1
        both.masked_fill_(~mask.view(1, count, 1, width, 1), 0.0)
        self.memory.index_fill_(1, slots, 0.0)
        self.memory[:, :, :, :width].index_copy_(1, slots, both)
        self.source_mask.index_fill_(0, slots, False)
        self.source_mask[:, :width].index_copy_(0, slots, mask)

    def clear(self, rows: Tensor) -> None:
        """New sentences' rows: nothing to clear (their history's columns are masked until
        written)."""

    def move(
        self, history_rows: Tensor, new_rows: Tensor, old: Tensor, new: Tensor, columns: int
    ) -> None:
        """Sentences from slots ``old`` to ``new``: rows ``new_rows`` take the history of rows
        ``history_rows`` (the first ``columns`` columns), slots their memory."""
        history = self.history[:, :, :, :columns]
        history.index_copy_(1, new_rows, history.index_select(1, history_rows))
        self.memory.index_copy_(1, new, self.memory.index_select(1, old))
        self.source_mask.index_copy_(0, new, self.source_mask.index_select(0, old))

    # ---- a step (static shapes) --------------------------------------------------------------

    def step(
        self, tokens: Tensor, positions: Tensor, reorder: Tensor, rows: int, columns: int,
        sources: int,
    ) -> Tensor:  # fmt: skip
        """The next token's logits ``[rows, vocab]`` of the first ``rows`` rows, each fed its
        token ``tokens[r]`` at column ``positions[r]``, after each row took the history of row
        ``reorder[r]`` (last step's beam order); columns and sources cut to the bucket's."""
        history = self.history[:, :, :, :columns]
        history[:, :rows] = history.index_select(1, reorder[:rows])
        view = self.view.decoder
        d, weights = view.decoder, view.weights
        tokens, positions = tokens[:rows], positions[:rows]
        x = self._embed(tokens, positions)
        own = torch.arange(columns, device=x.device) <= positions.unsqueeze(1)
        own = own.view(rows, 1, 1, columns)
        slots = rows // self.beam
        memory_mask = self.source_mask[:slots, :sources].view(slots, 1, 1, sources)
        at = torch.arange(rows, device=x.device)
        layers = zip(d.layers, weights.decoder_layers, strict=True)
        for index, (layer, prepared) in enumerate(layers):
            x = self._layer(
                layer, prepared, index, x, history, at, positions, own, memory_mask, sources
            )
        if d.layer_norm is not None:
            x = _norm(d.layer_norm, x)
        if d.project_out_dim is not None:
            x = d.project_out_dim(x)
        return weights.output(x)

    def _layer(
        self, layer: torch.nn.Module, prepared: LayerWeights, index: int, x: Tensor,
        history: Tensor, at: Tensor, positions: Tensor, own: Tensor, memory_mask: Tensor,
        sources: int,
    ) -> Tensor:  # fmt: skip
        """fairseq's decoder layer ``index`` on ``x`` ``[rows, embed]``."""
        rows, embed = x.shape
        heads, head_dim = self.heads, self.head_dim
        before, norm = layer.normalize_before, layer.self_attn_layer_norm
        qkv = prepared.self_qkv(_norm_input(norm, before, x))  # queries scaled already
        keys, values = history[2 * index], history[2 * index + 1]
        keys[at, :, positions] = qkv[:, embed : 2 * embed].view(rows, heads, head_dim)
        values[at, :, positions] = qkv[:, 2 * embed :].view(rows, heads, head_dim)
        query = qkv[:, :embed].view(rows, heads, 1, head_dim)
        context = attend(query, keys[:rows], values[:rows], own)
        x = prepared.self_out.plus(context.view(rows, embed), x, _post_norm(norm, before))
        norm = layer.encoder_attn_layer_norm
        query = prepared.cross_query(_norm_input(norm, before, x))
        slots = rows // self.beam
        query = query.view(slots, self.beam, heads, head_dim).transpose(1, 2)
        keys = self.memory[2 * index, :slots, :, :sources]
        values = self.memory[2 * index + 1, :slots, :, :sources]
        context = attend(query, keys, values, memory_mask)
        context = context.transpose(1, 2).reshape(rows, embed)
        x = prepared.cross_out.plus(context, x, _post_norm(norm, before))
        return _feed_forward(layer, prepared, x)

    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """fairseq's embedding of each row's token at its position (``positions``: tokens
        before it, BOS included, so fairseq's position ``pad + 1 + positions``)."""
        d = self.view.decoder.decoder
        x = d.embed_scale * d.embed_tokens(tokens)
        if d.quant_noise is not None:
            x = d.quant_noise(x)
        if d.project_in_dim is not None:
            x = d.project_in_dim(x)
        embed = d.embed_positions
        if embed is not None:
            index = positions + (d.padding_idx + 1)
            if isinstance(embed, LearnedPositionalEmbedding):
                x += F.embedding(index, embed.weight, embed.padding_idx)
            else:
                x += self.sinusoids.index_select(0, index)
        if d.layernorm_embedding is not None:
            x = d.layernorm_embedding(x)
        return x

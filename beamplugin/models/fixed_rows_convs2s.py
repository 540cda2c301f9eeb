"""Our ConvS2S decoder on fixed-capacity rows: the model half of the device step for convs2s
(beamplugin.engine.device_engine; the transformer's is beamplugin.models.fixed_rows_transformer,
whose interface this shares).

A row's state is its convolutions' input buffers (the last ``kernel_size`` inputs of each layer,
zeros before its first step), in buffers ``[rows, kernel_size, channels]`` updated in place; a
sentence slot's state is the attention memory of its source (keys and values from column 0 on,
the padding mask, the scale that undoes the read-out's averaging). A step runs the first
``rows`` rows over the first ``sources`` source positions, reads only static tensors and writes
in place, so that a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.models.convs2s import SQRT_HALF, ConvS2SModel, residual_input
from beamplugin.modules.row_attention import attend, own_columns


class FixedRowsConvS2S:
    """The decoder state of ``slots`` sentences of ``beam`` rows for ``model``: room for
    ``sources`` source positions a sentence (``columns``: unused, a convolution keeps its own
    window)."""

    def __init__(
        self, model: ConvS2SModel, slots: int, beam: int, columns: int, sources: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.model, self.beam = model, beam
        self.slots, self.columns, self.sources = slots, columns, sources
        decoder = model.decoder
        self.embed = decoder.embed_tokens.embedding_dim
        rows = slots * beam
        self.buffers = [
            torch.zeros((rows, conv.kernel_size, conv.in_channels), dtype=dtype, device=device)
            if conv.kernel_size > 1 else None
            for conv in decoder.convolutions
        ]  # fmt: skip
        shape = (slots, 1, sources, self.embed)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.source_mask = torch.zeros((slots, sources), dtype=torch.bool, device=device)
        self.scale = torch.zeros((slots, 1, 1, 1), dtype=dtype, device=device)

    def grown(self, slots: int, columns: int, sources: int) -> FixedRowsConvS2S:
        """A state with room for more, holding this one's contents at the same places."""
        new = FixedRowsConvS2S(
            self.model, slots, self.beam, columns, sources, self.keys.dtype, self.keys.device
        )
        rows = self.slots * self.beam
        for old, grown in zip(self.buffers, new.buffers, strict=True):
            if old is not None:
                grown[:rows] = old
        for name in ("keys", "values"):
            getattr(new, name)[: self.slots, :, : self.sources] = getattr(self, name)
        new.source_mask[: self.slots, : self.sources] = self.source_mask
        new.scale[: self.slots] = self.scale
        return new

    # ---- between steps ---------------------------------------------------------------------

    def write_memory(self, slots: Tensor, encoder_out: dict, first: int, count: int) -> None:
        """Put the attention memory of rows ``first .. first + count`` of ``encoder_out``
        (sources left-padded) into ``slots``, each source from column 0 on."""
        memory = encoder_out["attention_memory"]
        cut = slice(first, first + count)
        keys = memory["keys"][cut].transpose(1, 2)  # sentences, width, embed
        width = min(keys.size(1), self.sources)
        keys, values = keys[:, -width:], memory["values"][cut, -width:]
        bias = memory["bias"]
        if bias is None:
            own = torch.ones((count, width), dtype=torch.bool, device=keys.device)
        else:
            own = bias[cut, 0, -width:].isfinite()
        taken, mask = own_columns(own)
        index = taken.unsqueeze(2).expand_as(keys)
        dtype = self.keys.dtype
        for name, source in (("keys", keys), ("values", values)):
            moved = source.gather(1, index).to(dtype).masked_fill_(~mask.unsqueeze(2), 0.0)
            target = getattr(self, name)
            target.index_fill_(0, slots, 0.0)
            target[:, 0, :width].index_copy_(0, slots, moved)
        self.source_mask.index_fill_(0, slots, False)
        self.source_mask[:, :width].index_copy_(0, slots, mask)
        self.scale.index_copy_(0, slots, memory["scale"][cut].to(dtype).view(count, 1, 1, 1))

    def clear(self, rows: Tensor) -> None:
        """New sentences' rows start from zeroed input buffers."""
        for buffer in self.buffers:
            if buffer is not None:
                buffer.index_fill_(0, rows, 0.0)

    def move(
        self, history_rows: Tensor, new_rows: Tensor, old: Tensor, new: Tensor, columns: int
    ) -> None:
        """Sentences from slots ``old`` to ``new``: rows ``new_rows`` take the buffers of rows
        ``history_rows``, slots their memory."""
        for buffer in self.buffers:
            if buffer is not None:
                buffer.index_copy_(0, new_rows, buffer.index_select(0, history_rows))
        for tensor in (self.keys, self.values, self.source_mask, self.scale):
            tensor.index_copy_(0, new, tensor.index_select(0, old))

    # ---- a step (static shapes) --------------------------------------------------------------

    def step(
        self, tokens: Tensor, positions: Tensor, reorder: Tensor, rows: int, columns: int,
        sources: int,
    ) -> Tensor:  # fmt: skip
        """The next token's logits ``[rows, vocab]`` of the first ``rows`` rows, each fed its
        token ``tokens[r]`` at position ``positions[r]`` (tokens before it, BOS included), after
        each row took the buffers of row ``reorder[r]`` (last step's beam order)."""
        d = self.model.decoder
        order = reorder[:rows]
        for buffer in self.buffers:
            if buffer is not None:
                buffer[:rows] = buffer.index_select(0, order)
        x = d.embed_tokens(tokens[:rows]) + d.embed_positions.at(positions[:rows] + 1).squeeze(1)
        target = x
        x = d.fc1(x)
        slots = rows // self.beam
        keys, values = self.keys[:slots, :, :sources], self.values[:slots, :, :sources]
        mask = self.source_mask[:slots, :sources].view(slots, 1, 1, sources)
        scale = self.scale[:slots]
        residuals = [x]
        layers = zip(d.projections, d.convolutions, d.attention, d.residuals, self.buffers,
                     strict=True)  # fmt: skip
        for projection, conv, attention, distance, buffer in layers:
            residual = residual_input(residuals, distance, projection)
            if buffer is None:
                window = x
            else:
                buffer[:rows] = torch.cat([buffer[:rows, 1:], x.unsqueeze(1)], 1)
                window = buffer[:rows].reshape(rows, -1)
            weight = conv.derived_weight("linearized", conv._linearize)
            x = F.glu(conv.product(window, weight, conv.bias, "linearized"), dim=1)
            if attention is not None:
                query = (attention.in_projection(x) + target) * SQRT_HALF
                query = query.view(slots, 1, self.beam, self.embed)
                context = torch.mul(attend(query, keys, values, mask), scale)
                x = (attention.out_projection(context.view(rows, -1)) + x) * SQRT_HALF
            if residual is not None:
                x = (x + residual) * SQRT_HALF
            residuals.append(x)
        return d.fc3(d.fc2(x))


def serves(model: object) -> bool:
    """Whether this path decodes ``model`` (one of an ensemble's models, as the engine sees it)."""
    return isinstance(model, ConvS2SModel)

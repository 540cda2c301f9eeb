"""The self-attention keys and values of a transformer decoder's rows, kept from step to step
for rows at different steps (see beamplugin.models.mixed_step_transformer).

Every layer's live in one buffer ``[2 x layers, slots, heads, columns, head_dim]`` (keys of
layer ``l`` at ``2l``, values at ``2l + 1``). A step writes each row's key and value once, into
the next free column, in the slot of the row's index at that step; a table of sources
``[rows, width]`` says which slot holds each of a row's columns. So a beam reorder gathers that
table (rows x width integers), not the keys and values: copying the whole history at every
step took 7% of a decode at 64 sentences, more for longer ones (docs/speed.md). A step reads
the last ``width`` columns (a multiple of the vector lanes and at least ``least_width``, as the
memory pool's: bit-identical results alone or batched), each row's own steps last, the columns
before them for the decoder to mask. Every :data:`MOVE_EVERY` steps, or when the rows outgrow
the slots, the live columns move through the table to the start of the state's other buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.modules.memory_pool import LANES, lane_width, least_width
from beamplugin.runtime import pages
from beamplugin.runtime.buffer_pool import BufferPool

State = dict[str, Any]  # a decoder's incremental state: the keys below are this module's

MOVE_EVERY = 32  # steps between two moves of the live columns: wider buffers, fewer moves
ROOM_PER_ROW = 8  # slots a new buffer may hold per row (a first step's rows grow by the beam)


class Window(NamedTuple):
    """A step's history: ``keys_values`` ``[2 x layers, slots, heads, width, head_dim]``, row
    ``r``'s column ``j`` in slot ``sources[r, j]`` (``[rows, width]``), its last column in slot
    ``r`` (this step's, to be written)."""

    keys_values: Tensor
    sources: Tensor

    def gathered(self, index: int) -> Tensor:
        """``keys_values[index]`` of each row's own slots, ``[rows, heads, width, head_dim]``
        (a copy, for torch's batched products)."""
        by_column = self.keys_values[index].transpose(1, 2)  # slots, width, heads, head_dim
        columns = torch.arange(self.sources.size(1), device=self.sources.device)
        return by_column[self.sources, columns].transpose(1, 2)


class SelfAttentionHistory:
    """The history of ``layers`` self-attention layers of ``heads`` x ``head_dim``, in
    buffers lent by one pool for all the incremental states of a decoder."""

    def __init__(self, layers: int, heads: int, head_dim: int) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.least = least_width(head_dim)  # the fewest columns a step reads
        self.buffers = BufferPool()
        self._own: dict[tuple[int, torch.device], Tensor] = {}  # _own_slots' tensors
        self.most_rows = 0  # the most rows a step has had

    def advance(self, state: State, rows: int, steps: int, like: Tensor) -> Window:
        """This step's window for ``rows`` rows, the longest ``steps`` long: the last step's
        ``steps - 1`` columns, its rows in the order noted by :meth:`reorder` (a new row's from
        any row: masked), then a free column."""
        order = state.pop("order", None)
        width = max(lane_width(steps), self.least)
        buffer, end = state.get("buffer"), state.get("end", 0)
        sources = state.get("sources") if steps > 1 else None
        if buffer is None or buffer.size(1) < rows or end >= buffer.size(3) or end + 1 < width:
            buffer, end, sources = self._move(state, rows, steps, width, like, sources, order)
            order = None
        own = self._own_slots(rows, like.device)
        if sources is None:
            table = own.expand(rows, width).contiguous()  # masked columns: any slot will do
        else:
            kept = min(width - 1, sources.size(1))
            old = sources if order is None else sources.index_select(0, order)
            parts = [old[:, sources.size(1) - kept :], own]
            if kept < width - 1:  # the window widened: masked columns before
                parts.insert(0, own.expand(rows, width - 1 - kept))
            table = torch.cat(parts, 1)
        state["buffer"], state["end"], state["sources"] = buffer, end + 1, table
        return Window(buffer[:, :, :, end - width + 1 : end + 1], table)

    def _move(
        self,
        state: State,
        rows: int,
        steps: int,
        width: int,
        like: Tensor,
        sources: Tensor | None,
        order: Tensor | None,
    ) -> tuple[Tensor, int, Tensor | None]:
        """The state's other buffer, with ``rows`` slots and room for :data:`MOVE_EVERY`
        steps, the last ``steps - 1`` columns copied to its start, each row's into its own slot
        (through ``sources``, rows in ``order``): the buffer, the column after them, and their
        sources. A buffer's values are finite (masked columns weigh 0, and 0 x NaN is not 0)."""
        lease = state.get("lease")
        if lease is None:
            lease = state["lease"] = self.buffers.lease()
        kept = steps - 1
        # room for the window to widen as the longest row grows (read, never written: untouched
        # pages take no memory), and the kept columns from a lane boundary on, which is a page's
        # at head_dim 64: each head's run of columns takes the fewest pages
        start = lane_width(width + LANES - kept) + kept
        columns = lane_width(start + MOVE_EVERY)
        spare = state.pop("spare", None)
        if spare is None or spare.size(1) < rows or spare.size(3) < columns:
            if spare is not None:
                lease.give_back(spare)
            # a batch's first step has one row a sentence, the next beam rows: as many slots as
            # rows have been, up to ROOM_PER_ROW a row (not a large batch's for a small one)
            self.most_rows = max(self.most_rows, rows)
            slots = max(rows, min(self.most_rows, ROOM_PER_ROW * rows))
            shape = (2 * self.layers, slots, self.heads, columns, self.head_dim)
            spare = lease.take(shape, like, grows=(1, 3))
        old = state.get("buffer")
        # an old buffer too small for this state's next moves goes back to the pool, its pages
        # given back layer by layer as they are copied: the two are never both held whole
        outgrown = old is not None and (old.size(1) < rows or old.size(3) < columns)
        if old is not None and not outgrown:
            state["spare"] = old
        if old is None or sources is None or kept == 0:
            if outgrown:
                pages.discard(old)
                lease.give_back(old)
            return spare, start, None
        live = sources[:, sources.size(1) - kept :]
        if order is not None:
            live = live.index_select(0, order)
        end = state["end"]
        columns = _columns_of(old[0], live, torch.arange(end - kept, end, device=like.device))
        # a layer at a time: no copy of the whole live history beside the two buffers (0.25 GB
        # at 64 sentences of a base transformer, at the step that holds the most)
        for index in range(old.size(0)):
            moved = _by_column(old[index]).index_select(0, columns)
            spare[index, :rows, :, start - kept : start] = moved.view(rows, self.heads, kept, -1)
            if outgrown:
                pages.discard(old[index])
        if outgrown:
            lease.give_back(old)
        return spare, start, self._own_slots(rows, like.device).expand(rows, kept)

    def _own_slots(self, rows: int, device: torch.device) -> Tensor:
        """``[rows, 1]``: each row's own slot, where this step writes its key and value."""
        own = self._own.get((rows, device))
        if own is None:
            own = self._own[rows, device] = torch.arange(rows, device=device).view(rows, 1)
        return own

    @staticmethod
    def reorder(state: State, new_order: Tensor) -> None:
        """Keep the rows ``new_order`` at the next step (noted: it gathers their sources)."""
        noted = state.get("order")
        state["order"] = new_order if noted is None else noted.index_select(0, new_order)


def _by_column(layer: Tensor) -> Tensor:
    """A layer's buffer ``[slots, heads, columns, head_dim]`` (columns consecutive) as its
    columns, one a row (``[n, head_dim]``, a view): whole columns gathered by index_select
    move the history 2-2.5x faster than an advanced index of the buffer's dimensions."""
    slots, heads, columns, head_dim = layer.shape
    slot_stride, head_stride = layer.stride(0), layer.stride(1)
    n = ((slots - 1) * slot_stride + (heads - 1) * head_stride) // head_dim + columns
    return layer.as_strided((n, head_dim), (head_dim, 1))


def _columns_of(layer: Tensor, live: Tensor, columns: Tensor) -> Tensor:
    """``[rows x heads x kept]``: the row of :func:`_by_column` that holds column
    ``columns[c]`` of slot ``live[r, c]``, head by head, for each row ``r``."""
    heads, head_dim = layer.size(1), layer.size(3)
    slot_stride, head_stride = layer.stride(0) // head_dim, layer.stride(1) // head_dim
    head = torch.arange(heads, device=live.device).view(1, heads, 1)
    return (live.unsqueeze(1) * slot_stride + head * head_stride + columns).view(-1)


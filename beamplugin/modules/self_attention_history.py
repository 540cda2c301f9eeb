"""The self-attention keys and values of a transformer decoder's rows, kept from step to step
for rows at different steps (see beamplugin.models.mixed_step_transformer).

One tensor per step holds every layer's: ``[2 x layers, rows, heads, width, head_dim]`` (keys
of layer ``l`` at ``2l``, values at ``2l + 1``), each row's own steps last, the very last column
this step's, the width a multiple of the vector lanes and at least ``least_width`` (as the
memory pool's: bit-identical results alone or batched), the columns before a row's own steps
for the decoder to mask. A reorder is only noted; the next step gathers the rows it keeps into
the other of two buffers, one copy for all layers (rows of sentences that join are gathered
from any row: their columns are masked). Skipping that copy was measured slower
(docs/speed.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from beamplugin.modules.memory_pool import lane_width, least_width
from beamplugin.runtime.buffer_pool import BufferPool

State = dict[str, Any]  # a decoder's incremental state: the keys below are this module's


class SelfAttentionHistory:
    """The history of ``layers`` self-attention layers of ``heads`` x ``head_dim``, in
    buffers lent by one pool for all the incremental states of a decoder."""

    def __init__(self, layers: int, heads: int, head_dim: int) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.least = least_width(head_dim)  # the fewest columns a step reads
        self.buffers = BufferPool()

    def advance(self, state: State, rows: int, steps: int, like: Tensor) -> Tensor:
        """This step's history of ``rows`` rows, the longest ``steps`` long: the last step's
        ``steps - 1`` columns, its rows gathered in the order noted by :meth:`reorder`, then a
        free column.

        Steps alternate between two buffers lent by the pool, their rows and columns at least
        this step's (the history is the first rows and the last columns), their values finite
        (masked where they are not a row's own: 0 x NaN would not be 0), so that nothing is
        cleared or allocated until the rows or the width outgrow them."""
        old, order = state.get("history"), state.pop("order", None)
        width = max(lane_width(steps), self.least)
        lease = state.get("lease")
        if lease is None:
            lease = state["lease"] = self.buffers.lease()
        buffer = state.get("spare")
        if buffer is None or buffer.size(1) < rows or buffer.size(3) < width:
            columns = width
            if buffer is not None:
                lease.give_back(buffer)
                if buffer.size(3) < width:  # a long sentence: fewer, larger new buffers
                    columns = max(width, 2 * buffer.size(3))
            shape = (2 * self.layers, rows, self.heads, columns, self.head_dim)
            buffer = lease.take(shape, like, grows=(1, 3))
        history = buffer[:, :rows, :, buffer.size(3) - width :]
        if old is not None and steps > 1:
            window = old[:, :, :, old.size(3) - steps + 1 :]
            kept = history[:, :, :, width - steps : -1]
            if order is None:
                kept.copy_(window)
            else:
                torch.index_select(window, 1, order, out=kept)
        if "buffer" in state:
            state["spare"] = state["buffer"]
        state["buffer"], state["history"] = buffer, history
        return history

    @staticmethod
    def reorder(state: State, new_order: Tensor) -> None:
        """Keep the rows ``new_order`` at the next step (noted: it gathers them)."""
        noted = state.get("order")
        state["order"] = new_order if noted is None else noted.index_select(0, new_order)

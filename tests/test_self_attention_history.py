"""A transformer decoder's self-attention history (beamplugin.modules.self_attention_history):
each row reads the keys and values its beam wrote, step after step, through reorders, rows
joining and the moves to the other buffer; a reorder moves the table of sources, not the keys
and values."""

from __future__ import annotations

import pytest
import torch

from beamplugin.modules import self_attention_history
from beamplugin.modules.self_attention_history import SelfAttentionHistory

LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def written(step: int, rows: int) -> torch.Tensor:
    """What the rows write at ``step``: ``[2 x layers, rows, heads, head_dim]``, distinct."""
    torch.manual_seed(step)
    return torch.randn(2 * LAYERS, rows, HEADS, HEAD_DIM)


@pytest.mark.parametrize("move_every", [32, 3])
def test_each_row_reads_what_its_beam_wrote_and_a_reorder_copies_no_keys(
    monkeypatch, move_every
):
    monkeypatch.setattr(self_attention_history, "MOVE_EVERY", move_every)
    history = SelfAttentionHistory(LAYERS, HEADS, HEAD_DIM)
    state: dict = {}
    like = torch.zeros(1, HEADS * HEAD_DIM)
    rows = 3
    own: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # each row's columns, in order
    moves = 0
    for step in range(1, 45):
        before = state.get("buffer")
        snapshot = None if before is None else before.clone()
        window = history.advance(state, rows, step, like)
        if before is not None and state["buffer"] is before:
            assert torch.equal(before, snapshot)  # nothing copied or written by the advance
        else:
            moves += before is not None
        new = written(step, rows)
        window.keys_values[:, :rows, :, -1] = new
        for row in range(rows):
            own[row].append(new[:, row])  # [2 x layers, heads, head_dim]
        width = window.sources.size(1)
        for index in range(2 * LAYERS):
            got = window.gathered(index)  # rows, heads, width, head_dim
            for row in range(rows):
                expected = torch.stack([column[index] for column in own[row]], dim=1)
                assert torch.equal(got[row, :, width - len(own[row]) :], expected), (step, row)
        if step == 20:  # a fourth row joins (from any row: its columns are masked)
            order = torch.tensor([2, 0, 0, 1])
            rows = 4
        else:
            order = torch.tensor([2, 2, 0, 1][:rows])  # beams reordered, one beam twice
        own = [list(own[i]) for i in order.tolist()]
        history.reorder(state, order)
        if step == 20:
            own[-1] = []  # the new row's own steps start at the next step
    # a buffer has room for MOVE_EVERY steps and up to a lane's more (its columns lane-wide)
    assert moves >= (1 if move_every == 32 else 3)

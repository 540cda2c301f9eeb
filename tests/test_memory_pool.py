"""The convs2s attention memory pool on hand-made memories: slots written, moved, widened and
narrowed, and the decoder's view always showing the current slots, in groups each cut to its
widest source; widths in multiples of the vector lanes.

The mechanics are checked with one position a lane (``LANES`` = 1), so that widths are the
sources' own."""

from __future__ import annotations

import pytest
import torch

from beamplugin.modules import MemoryPool, attention_memory_pool
from beamplugin.modules import memory_pool as memory_pool_module
from beamplugin.modules.attention import ATTENTION_MEMORY_LAYOUT
from beamplugin.modules.memory_pool import NAIVE_PRODUCTS


@pytest.fixture
def one_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_pool_module, "LANES", 1)


def memory(values: list[list[float]], padded: list[int] | None = None) -> dict:
    """An encoder output of sentences whose values are ``values[s]`` per source position
    (embed dim 2: the value and its negation), the first ``padded[s]`` positions padding."""
    v = torch.tensor(values, dtype=torch.float).unsqueeze(2).repeat(1, 1, 2)
    v[:, :, 1] *= -1
    bias = None
    if padded is not None:
        mask = torch.arange(v.size(1)).unsqueeze(0) < torch.tensor(padded).unsqueeze(1)
        bias = torch.zeros(mask.shape).masked_fill(mask, -torch.inf).unsqueeze(1)
    scale = torch.arange(1.0, len(values) + 1).view(-1, 1, 1)
    out = {"keys": v.transpose(1, 2).contiguous(), "values": v, "bias": bias, "scale": scale}
    return {"attention_memory": out}


def slots(pool: MemoryPool, n: int) -> list[tuple[list[float], list[bool], float]]:
    """Per slot: its values (first channel), masked positions and scale, as the decoder sees them
    when it reads the first ``n`` slots as one group."""
    [(view, rows)] = pool.view([(n, 1)])["attention_groups"]
    assert rows == n
    return seen(view)


def seen(view: dict) -> list[tuple[list[float], list[bool], float]]:
    n, bias = view["keys"].size(0), view["bias"]
    rows = []
    for s in range(n):
        assert torch.equal(view["keys"][s], view["values"][s].t())
        masked = [False] * view["values"].size(1)
        if bias is not None:  # -inf where masked, else 0
            assert set(bias[s, 0].tolist()) <= {0.0, -torch.inf}
            masked = bias[s, 0].isinf().tolist()
        rows.append((view["values"][s, :, 0].tolist(), masked, float(view["scale"][s])))
    return rows


def test_slots_are_written_moved_widened_and_narrowed(one_lane):
    pool = attention_memory_pool(NAIVE_PRODUCTS)
    pool.write(0, memory([[1, 2], [3, 4]]), slice(0, 2), 2)  # a new batch is taken as it is
    assert slots(pool, 2) == [([1, 2], [False, False], 1.0), ([3, 4], [False, False], 2.0)]
    # wider: everything left-padded
    pool.write(2, memory([[0, 5, 6, 7]], padded=[1]), slice(0, 1), 4)
    assert slots(pool, 3) == [
        ([0, 0, 1, 2], [True, True, False, False], 1.0),
        ([0, 0, 3, 4], [True, True, False, False], 2.0),
        ([0, 5, 6, 7], [True, False, False, False], 1.0),
    ]
    pool.rearrange([2, 1])  # sentence 0 left: the last one takes its slot
    assert slots(pool, 2) == [
        ([0, 5, 6, 7], [True, False, False, False], 1.0),
        ([0, 0, 3, 4], [True, True, False, False], 2.0),
    ]
    pool.write(2, memory([[8]]), slice(0, 1), 1)  # narrower: padded to the pool's width
    assert slots(pool, 3)[2] == ([0, 0, 0, 8], [True, True, True, False], 1.0)
    pool.rearrange([2])  # only the one-token source stays: the pool narrows to it
    assert pool.width == 1
    assert slots(pool, 1) == [([8], [False], 1.0)]
    pool.write(1, memory([[9, 10, 11, 12, 13]]), slice(0, 1), 5)  # grows again, beyond its capacity
    assert slots(pool, 2) == [
        ([0, 0, 0, 0, 8], [True, True, True, True, False], 1.0),
        ([9, 10, 11, 12, 13], [False] * 5, 1.0),
    ]
    pool.write(0, memory([[7, 7]]), slice(0, 1), 2)  # a new batch replaces everything
    assert slots(pool, 1) == [([7, 7], [False, False], 1.0)]


def test_rows_of_a_wider_encoder_output_are_written_at_their_own_width(one_lane):
    """Sentences encoded together ahead of admission join one by one: each write takes its
    rows, cut to their own width (a new batch's as a view, not a copy), and never changes the
    rows of the encoder output the others wait in."""
    encoded = memory([[0, 0, 1], [0, 2, 3], [4, 5, 6]], padded=[2, 1, 0])
    waiting = slice(2, 3)
    before = {k: v[waiting].clone() for k, v in encoded["attention_memory"].items()}
    pool = attention_memory_pool(NAIVE_PRODUCTS)
    pool.write(0, encoded, slice(0, 2), 2)
    storage = {k: t.untyped_storage().data_ptr() for k, t in encoded["attention_memory"].items()}
    assert {k: t.untyped_storage().data_ptr() for k, t in pool.memory.items()} == storage
    assert pool.width == 2
    assert slots(pool, 2) == [([0, 1], [True, False], 1.0), ([2, 3], [False, False], 2.0)]
    pool.rearrange([1])
    pool.write(1, encoded, slice(2, 3), 3)
    assert slots(pool, 2) == [([0, 2, 3], [True, False, False], 2.0),
                              ([4, 5, 6], [False, False, False], 3.0)]
    for name, tensor in encoded["attention_memory"].items():
        assert torch.equal(tensor[waiting], before[name]), name


def test_the_decoder_reads_groups_of_slots_each_cut_to_its_widest_source(one_lane):
    pool = attention_memory_pool(NAIVE_PRODUCTS)
    pool.write(0, memory([[1, 2]]), slice(0, 1), 2)
    pool.write(1, memory([[3, 4, 5, 6]]), slice(0, 1), 4)
    pool.write(2, memory([[8]]), slice(0, 1), 1)
    assert pool.width == 4
    (first, rows), (second, second_rows) = pool.view([(2, 3), (1, 1)])["attention_groups"]
    assert (rows, second_rows) == (6, 1)  # sentences x rows each
    assert seen(first) == [([0, 0, 1, 2], [True, True, False, False], 1.0),
                           ([3, 4, 5, 6], [False] * 4, 1.0)]
    assert seen(second) == [([8], [False], 1.0)]
    (narrow, _), (wide, _) = pool.view([(1, 1), (2, 1)])["attention_groups"]
    assert seen(narrow) == [([1, 2], [False, False], 1.0)]
    assert seen(wide) == [([3, 4, 5, 6], [False] * 4, 1.0),
                          ([0, 0, 0, 8], [True, True, True, False], 1.0)]


def test_widths_are_multiples_of_the_lanes(monkeypatch):
    """Every width the decoder reads is a multiple of the lanes, each sentence's own positions
    last: a new batch of width 2 is padded to 4, a group is cut to its widest source rounded
    up, and the pool narrows only to a multiple of the lanes."""
    monkeypatch.setattr(memory_pool_module, "LANES", 4)
    pool = attention_memory_pool(NAIVE_PRODUCTS)
    pool.write(0, memory([[1, 2]]), slice(0, 1), 2)
    assert pool.width == 4
    assert slots(pool, 1) == [([0, 0, 1, 2], [True, True, False, False], 1.0)]
    pool.write(1, memory([[3, 4, 5, 6, 7]]), slice(0, 1), 5)
    assert pool.width == 8
    (first, _), (second, _) = pool.view([(1, 1), (1, 1)])["attention_groups"]
    assert seen(first) == [([0, 0, 1, 2], [True, True, False, False], 1.0)]
    assert seen(second) == [([0, 0, 0, 3, 4, 5, 6, 7], [True] * 3 + [False] * 5, 1.0)]
    pool.rearrange([0])
    assert pool.width == 4
    assert slots(pool, 1) == [([0, 0, 1, 2], [True, True, False, False], 1.0)]


def test_a_pool_of_narrow_keys_reads_at_least_the_width_of_a_blas_product(monkeypatch):
    """With 8-wide keys one query row needs 50 positions for torch to take its BLAS kernel
    (NAIVE_PRODUCTS multiply-adds): reads are at least that, lane-wide, however short the
    sources; wider sources widen them as before."""
    monkeypatch.setattr(memory_pool_module, "LANES", 4)
    pool = attention_memory_pool(8)
    assert pool.least == 52
    pool.write(0, memory([[1, 2]]), slice(0, 1), 2)
    assert pool.width == 52
    (group, _), = pool.view([(1, 1)])["attention_groups"]
    assert seen(group) == [([0] * 50 + [1, 2], [True] * 50 + [False] * 2, 1.0)]
    pool.write(1, memory([[3] * 60]), slice(0, 1), 60)
    assert pool.width == 60
    pool.rearrange([0])
    assert pool.width == 60  # narrowing to 52 would not halve it


def test_a_padded_encoder_outputs_new_batch_is_a_view_read_as_wide_as_the_pool_reads(one_lane):
    """An encoder output that holds the layout's padding at every position before a sentence's
    own (``padded``, as the transformer's) gives a new batch its memory as a view, read wider
    than the sentence's own width: the slots a pool that copies and pads shows."""
    encoded = memory([[0, 0, 1], [0, 2, 3]], padded=[2, 1])
    viewed = MemoryPool(ATTENTION_MEMORY_LAYOUT, 134, padded=True)  # reads 3 positions at least
    copied = MemoryPool(ATTENTION_MEMORY_LAYOUT, 134)
    for pool in (viewed, copied):
        pool.write(0, encoded, slice(1, 2), 2)
    assert slots(viewed, 1) == slots(copied, 1) == [([0, 2, 3], [True, False, False], 2.0)]
    source = encoded["attention_memory"]["values"].untyped_storage().data_ptr()
    assert viewed.memory["values"].untyped_storage().data_ptr() == source
    assert copied.memory["values"].untyped_storage().data_ptr() != source

"""An encoder batch in groups of similar width (beamplugin.modules.width_groups): the split
that costs least, and a transformer's encoder memory that is, bit for bit, the batch's encoded
as one group."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from builders import build_transformer, make_batch

from beamplugin import SequenceGenerator
from beamplugin.kernels import instruction_sets
from beamplugin.models import mixed_step_transformer
from beamplugin.modules.width_groups import CALL_ROWS, width_groups

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]


def cheapest(lengths: list[int]) -> int:
    """The least cost of any split of the sorted lengths into runs, every split tried."""
    ordered = sorted(lengths)
    best = None
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        cost, first = 0, 0
        for i, cut in enumerate([*cuts, True]):
            if cut:
                cost += CALL_ROWS + (i + 1 - first) * ordered[i]
                first = i + 1
        best = cost if best is None else min(best, cost)
    return best


def test_the_groups_hold_every_sentence_once_at_their_widest_and_cost_least():
    rng = random.Random(3)
    for _ in range(40):
        lengths = [rng.choice([1, 2, 5, 9, 30, 31, 80]) for _ in range(rng.randint(1, 10))]
        groups = width_groups(lengths)
        assert sorted(i for group, _ in groups for i in group) == list(range(len(lengths)))
        assert all(width == max(lengths[i] for i in group) for group, width in groups)
        widths = [width for _, width in groups]
        assert widths == sorted(set(widths))  # narrowest first, runs of the sorted lengths
        cost = sum(CALL_ROWS + len(group) * width for group, width in groups)
        assert cost == cheapest(lengths)


def test_a_batch_in_width_groups_has_the_memory_of_one_group_bit_for_bit(
    vocab, monkeypatch, kernels_for
):
    # ours (the set asked for, else the best here), whatever a trial would say
    best = next(isa for isa in instruction_sets.SETS if instruction_sets.runs_here(isa))
    name = os.environ.get(instruction_sets.CHOICE) or best.name
    if name == "off":
        pytest.skip("our kernels are off: the encoder runs in one group, torch's")
    kernels_for(name)
    model = build_transformer(vocab, seed=5)
    encoder = SequenceGenerator([model], vocab, beam_size=2).model.models[0].encoder
    assert encoder.weights.current().encoder_in_kernel is not None  # the groups' path
    net_input = make_batch(vocab, 12, seed=4, lengths=(1, 40))["net_input"]
    groups = width_groups(
        (net_input["src_tokens"].ne(vocab.pad()).sum(1)).tolist()
    )  # the sources are left-padded: a sentence's span is its length
    assert len(groups) > 1
    with torch.inference_mode():
        grouped = encoder.forward_torchscript(net_input)["attention_memory"]
        whole = [(list(range(12)), net_input["src_tokens"].size(1))]
        monkeypatch.setattr(mixed_step_transformer, "width_groups", lambda spans: whole)
        one = encoder.forward_torchscript(net_input)["attention_memory"]
    assert grouped.keys() == one.keys()
    for name in one:
        assert torch.equal(grouped[name], one[name]), name

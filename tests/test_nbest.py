"""The n-best keeper's order: best first, as fairseq's sort orders its finished hypotheses."""

import math

import pytest
import torch

from beamplugin.search.nbest import NBest


def _kept(scores: list[float], evict_worst: bool = False, size: int = 8) -> NBest:
    nbest: NBest[int] = NBest(size, evict_worst)
    for index, score in enumerate(scores):
        nbest.add(score, index)
    return nbest


@pytest.mark.parametrize(
    "scores",
    [
        [-1.5, -0.25, -3.0, -0.5],  # distinct
        [-1.0, -0.5, -1.0, -0.5, -2.0],  # equal scores
        [-1.0, -math.inf, -0.5, -math.inf],  # dead hypotheses
        [-1.0, math.nan, -0.5],  # a NaN score
    ],
)
def test_best_first_is_fairseqs_sort(scores: list[float]) -> None:
    expected = torch.sort(torch.tensor(scores), descending=True).indices.tolist()
    for count in range(1, len(scores) + 1):
        assert _kept(scores).best_first(count) == expected[:count]


def test_a_full_keeper_evicts_its_worst_only_for_a_better_one() -> None:
    nbest = _kept([-1.0, -3.0, -2.0], evict_worst=True, size=3)
    assert nbest.worst_score() == -3.0
    nbest.add(-4.0, 3)  # worse than all: not kept
    nbest.add(-0.5, 4)  # replaces -3.0
    assert nbest.best_first(3) == [4, 0, 2]
    assert nbest.worst_score() == -2.0
    fairseq_rule = _kept([-1.0, -3.0, -2.0, 0.0], evict_worst=False, size=3)
    assert fairseq_rule.best_first(3) == [0, 2, 1]  # the first three that finished

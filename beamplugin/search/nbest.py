"""The n-best keeper: the finished hypotheses of one sentence."""

from __future__ import annotations

import math
from typing import Any, Generic, TypeVar

import torch

Hypothesis = dict[str, Any]  # fairseq's: tokens, score, attention, alignment, positional_scores
T = TypeVar("T")


class NBest(Generic[T]):
    """At most ``size`` finished hypotheses of one sentence (whatever stands for them), each
    with its score.

    fairseq's rule keeps the first ``size`` that finish (the sentence stops then); with
    ``evict_worst`` (exact stopping, which searches on) a better hypothesis replaces the worst.
    """

    def __init__(self, size: int, evict_worst: bool) -> None:
        self.size = size
        self.evict_worst = evict_worst
        self.scores: list[float] = []
        self.hypotheses: list[T] = []

    def __len__(self) -> int:
        return len(self.hypotheses)

    def add(self, score: float, hypothesis: T) -> None:
        if len(self.hypotheses) < self.size:
            self.scores.append(score)
            self.hypotheses.append(hypothesis)
        elif self.evict_worst:
            worst = min(range(len(self.scores)), key=self.scores.__getitem__)
            if score > self.scores[worst]:
                self.scores[worst], self.hypotheses[worst] = score, hypothesis

    def worst_score(self) -> float:
        """The score a new hypothesis must beat once the list is full (-inf before)."""
        if len(self.hypotheses) < self.size:
            return -math.inf
        return min(self.scores)

    def best_first(self, count: int) -> list[T]:
        scores = self.scores
        if len(set(scores)) == len(scores) and not any(map(math.isnan, scores)):
            order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        else:  # the same sort call as fairseq, so that equal scores keep fairseq's order
            order = torch.sort(torch.tensor(scores), descending=True).indices.tolist()
        return [self.hypotheses[i] for i in order[:count]]

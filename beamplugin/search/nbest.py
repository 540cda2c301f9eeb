"""The n-best keeper: the finished hypotheses of one sentence."""

from __future__ import annotations

import math
from typing import Any

import torch

Hypothesis = dict[str, Any]


class NBest:
    """At most ``size`` finished hypotheses of one sentence.

    fairseq's rule keeps the first ``size`` that finish (the sentence stops then); with
    ``evict_worst`` (exact stopping, which searches on) a better hypothesis replaces the worst.
    """

    def __init__(self, size: int, evict_worst: bool) -> None:
        self.size = size
        self.evict_worst = evict_worst
        self.hypotheses: list[Hypothesis] = []

    def __len__(self) -> int:
        return len(self.hypotheses)

    def add(self, hypothesis: Hypothesis) -> None:
        if len(self.hypotheses) < self.size:
            self.hypotheses.append(hypothesis)
        elif self.evict_worst:
            scores = [float(h["score"]) for h in self.hypotheses]
            worst = min(range(len(scores)), key=scores.__getitem__)
            if float(hypothesis["score"]) > scores[worst]:
                self.hypotheses[worst] = hypothesis

    def worst_score(self) -> float:
        """The score a new hypothesis must beat once the list is full (-inf before)."""
        if len(self.hypotheses) < self.size:
            return -math.inf
        return min(float(h["score"]) for h in self.hypotheses)

    def best_first(self, count: int) -> list[Hypothesis]:
        # The same sort call as fairseq, so that equal scores keep fairseq's order.
        scores = torch.tensor([float(h["score"]) for h in self.hypotheses])
        order = torch.sort(scores, descending=True).indices.tolist()
        return [self.hypotheses[i] for i in order[:count]]

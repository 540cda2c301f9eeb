"""Learned positional embeddings with fairseq's numbering (positions start after padding_idx)."""

from __future__ import annotations

import torch.nn.functional as F
from fairseq import utils
from torch import Tensor, nn


class LearnedPositions(nn.Embedding):
    """``num_embeddings`` rows, as fconv allocates them: the first ``padding_idx + 1`` rows are
    not positions, so ``max_positions`` is ``num_embeddings - padding_idx - 1``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        nn.init.normal_(self.weight, 0.0, 0.1)
        nn.init.zeros_(self.weight[padding_idx])

    @property
    def max_positions(self) -> int:
        return self.num_embeddings - self.padding_idx - 1

    def forward(self, tokens: Tensor) -> Tensor:
        """Embeddings of the positions of batch x len tokens; padding gets the zero row."""
        return F.embedding(utils.make_positions(tokens, self.padding_idx), self.weight)

    def at(self, lengths: Tensor) -> Tensor:
        """``[rows, 1, dim]``: per row, the embedding of the last position of a prefix of
        ``lengths[row]`` tokens (padding not counted)."""
        return F.embedding(lengths + self.padding_idx, self.weight).unsqueeze(1)

"""The vocabulary columns a step's rows may take (a shortlist per sentence), and logits widened
back to the whole vocabulary.

A decoder that honours them computes the logits of ``columns`` alone (the shortlists of every
sentence in flight, one product) and :meth:`OutputColumns.widen`s them: each row keeps its own
sentence's columns, every other token is -inf. The search then reads a row of the usual width
whose probabilities are normalised over that sentence's shortlist, with each token in its own
column, so a sentence's bits do not depend on what its batch-mates' shortlists add.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor


class OutputColumns(NamedTuple):
    """``columns`` ``[n]``: the token ids any row may take, ascending; ``keep`` ``[rows, n]``:
    those each row's own sentence may; ``wide``: the last widened logits' buffer, kept while
    these columns are (every step writes the same columns, the others stay -inf)."""

    columns: Tensor
    keep: Tensor
    wide: dict[tuple[Any, ...], Tensor]

    def for_rows(self, row_sentences: Tensor) -> OutputColumns:
        """Per-sentence ``keep`` made per row (``row_sentences``: each row's sentence); the same
        ``columns`` tensor."""
        return OutputColumns(self.columns, self.keep.index_select(0, row_sentences), self.wide)

    def narrow(self, vocab: int) -> bool:
        """Whether multiplying these columns alone pays, out of ``vocab``: where the shortlists
        in flight cover more than half of it (a batch of 64 sentences on a 32k vocabulary),
        packing the columns anew as sentences come and go saves no time and holds a second copy
        of most of the projection: the whole product and :meth:`restrict` instead (the same
        bits either way)."""
        return 2 * self.columns.numel() <= vocab

    def widen(self, logits: Tensor, vocab: int) -> Tensor:
        """``logits`` of ``columns`` (``[rows, n]``) as ``[rows, vocab]``, -inf at every token
        a row may not take. The result is overwritten by the next call: read it before (the
        log-softmax that follows makes its own)."""
        key = (logits.size(0), vocab, logits.dtype, logits.device)
        out = self.wide.get(key)
        if out is None:  # a 256k vocabulary's rows: filled once, not at every step
            self.wide.clear()
            out = self.wide[key] = logits.new_full((logits.size(0), vocab), -math.inf)
        return out.index_copy_(1, self.columns, logits.masked_fill(~self.keep, -math.inf))

    def restrict(self, logits: Tensor) -> Tensor:
        """Logits of the whole vocabulary (``[rows, vocab]``, or ``[rows, 1, vocab]``) with
        -inf at every token a row may not take (for decoders that compute every column)."""
        flat = logits.reshape(logits.size(0), -1)
        kept = self.widen(flat.index_select(1, self.columns), flat.size(1))
        return kept.view_as(logits)


def shortlist_columns(shortlists: list[Tensor], device: torch.device | None) -> OutputColumns:
    """The columns of sentences whose shortlists (ascending token ids) are ``shortlists``,
    ``keep`` per sentence (:meth:`OutputColumns.for_rows` makes it per row)."""
    columns = torch.unique(torch.cat(shortlists))
    keep = torch.zeros(len(shortlists), columns.numel(), dtype=torch.bool)
    for sentence, shortlist in enumerate(shortlists):
        keep[sentence, torch.searchsorted(columns, shortlist)] = True
    return OutputColumns(columns.to(device), keep.to(device), {})

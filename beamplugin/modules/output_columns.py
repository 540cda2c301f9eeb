"""The vocabulary columns a step's rows may take (a shortlist per sentence), and log-probs
normalised over each row's own.

A decoder that honours them computes the logits of ``columns`` alone (the shortlists of every
sentence in flight, one product) where they are few (:meth:`OutputColumns.narrow`), else of
every token. :meth:`OutputColumns.log_softmax` reads each row's own sentence's columns of
either, normalises the row over them alone, and writes a row of the usual width (-inf at every
other token) for the search, each token in its own column. A sentence's bits do not depend on
what its batch-mates' shortlists add.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import log_probs

# The log-softmax's rows are at least this wide: torch's takes rows narrower than one vector (16
# floats on AVX-512) another way, so a short shortlist alone would not get its bits in a batch.
MIN_WIDTH = 64


class OutputColumns(NamedTuple):
    """``columns`` ``[n]``: the token ids any row may take, ascending; ``own``
    ``[rows, longest]``: each row's own token ids,
    ascending, from the first column on, and ``own_at`` where they are in ``columns``
    (``own_valid`` says which are; the rest is padding); ``buffers``: the last log-probs and
    restricted logits, kept while these columns are (every step writes the same places, the
    others stay -inf)."""

    columns: Tensor
    own: Tensor
    own_at: Tensor
    own_valid: Tensor
    buffers: dict[str, Tensor]

    def for_rows(self, row_sentences: Tensor) -> OutputColumns:
        """The per-sentence ``own*`` made per row (``row_sentences``: each row's
        sentence); the same ``columns`` tensor and buffers."""
        return OutputColumns(
            self.columns,
            self.own.index_select(0, row_sentences),
            self.own_at.index_select(0, row_sentences),
            self.own_valid.index_select(0, row_sentences),
            self.buffers,
        )

    def narrow(self, vocab: int) -> bool:
        """Whether multiplying these columns alone pays, out of ``vocab``: where the shortlists
        in flight cover more than half of it (a batch of 64 sentences on a 32k vocabulary),
        packing the columns anew as sentences come and go saves no time and holds a second copy
        of most of the projection: the whole product instead (the same bits either way)."""
        return 2 * self.columns.numel() <= vocab

    def log_softmax(self, logits: Tensor, vocab: int, temperature: float = 1.0) -> Tensor:
        """Float32 log-probs ``[rows, vocab]`` of ``logits``, those of ``columns`` alone
        (``[rows, n]``) or of every token (``[rows, vocab]``): each row normalised over its own
        sentence's columns alone, -inf elsewhere. Each row's own logits are gathered in token
        order to the front of a row as long as the longest shortlist, so its sum runs over the
        same values in the same lanes whoever shares the step (trailing -inf adds exact zeros;
        tests/test_vocabulary_map.py checks it), and a shortlist of every token gives the
        whole row's log-probs (the kernel the model's vocabulary takes:
        beamplugin.kernels.log_probs). The result is overwritten by the next call."""
        own = self.own_at if logits.size(1) == self.columns.numel() else self.own
        gathered = logits.gather(1, own).float().masked_fill_(~self.own_valid, -math.inf)
        if temperature != 1.0:
            gathered = gathered / temperature
        if not log_probs.log_softmax_(gathered, vocab):
            gathered = torch.log_softmax(gathered, 1)
        return self._write_own("log_probs", gathered, vocab)

    def restrict(self, logits: Tensor) -> Tensor:
        """Logits of the whole vocabulary (``[rows, vocab]``, or ``[rows, 1, vocab]``) with
        -inf at every token a row may not take (for decoders that compute every column and
        normalise them themselves). The result is overwritten by the next call."""
        flat = logits.reshape(logits.size(0), -1)
        own = self._write_own("restricted", flat.gather(1, self.own), flat.size(1))
        return own.view_as(logits)

    def _write_own(self, kind: str, values: Tensor, vocab: int) -> Tensor:
        """``values`` (``[rows, longest]``, laid out as ``own``) in their tokens' columns of a
        ``[rows, vocab]`` buffer of -inf kept for ``kind`` while its shape, dtype and device are
        (a 256k vocabulary's rows: filled once, not at every step). Within one set of columns
        the rows' sentences follow from their count (the one-row sentences come last), so the
        same places are written at every step."""
        rows = values.size(0)
        out = self.buffers.get(kind)
        if out is None or out.shape != (rows, vocab) or out.dtype != values.dtype or (
            out.device != values.device
        ):
            out = self.buffers[kind] = values.new_full((rows, vocab), -math.inf)
        at = torch.arange(rows, device=values.device).unsqueeze(1) * vocab + self.own
        valid = self.own_valid
        out.view(-1).index_copy_(0, at[valid], values[valid])
        return out


def shortlist_columns(shortlists: list[Tensor], device: torch.device | None) -> OutputColumns:
    """The columns of sentences whose shortlists (ascending token ids, each once) are
    ``shortlists``, and ``own*`` per sentence (:meth:`OutputColumns.for_rows` makes them
    per row)."""
    columns = torch.unique(torch.cat(shortlists))
    longest = max(MIN_WIDTH, *(shortlist.numel() for shortlist in shortlists))
    own = torch.zeros(len(shortlists), longest, dtype=torch.long)
    own_at = torch.zeros(len(shortlists), longest, dtype=torch.long)
    own_valid = torch.zeros(len(shortlists), longest, dtype=torch.bool)
    for sentence, shortlist in enumerate(shortlists):
        own[sentence, : shortlist.numel()] = shortlist
        own_at[sentence, : shortlist.numel()] = torch.searchsorted(columns, shortlist)
        own_valid[sentence, : shortlist.numel()] = True
    on_device = (columns, own, own_at, own_valid)
    return OutputColumns(*(t.to(device) for t in on_device), {})

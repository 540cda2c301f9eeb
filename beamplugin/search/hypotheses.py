"""The hypotheses that end in one step, as their rows came from the decoder's histories: made
into fairseq's hypothesis dicts only for those a result returns (most of those that end do not:
a sentence keeps beam of them and returns nbest, 1 by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.search.nbest import Hypothesis


class EndedRows:
    """Hypotheses ending in EOS, one per row, on the host: ``tokens`` ``[rows, columns]`` and
    ``cumulative`` ``[rows, columns - 1]`` (the token and cumulative score histories, BOS and
    the score 0 first, rows of different lengths left-padded), ``eos_cumulative`` and
    ``scores`` ``[rows]`` (the cumulative score with EOS, and the score that ranks the
    hypothesis), ``attention`` ``[rows, src, columns]`` or None, and per row its ``lengths``
    (tokens, EOS included) and ``widths`` (source positions)."""

    def __init__(
        self,
        tokens: Tensor,
        cumulative: Tensor,
        eos_cumulative: Tensor,
        scores: Tensor,
        attention: Tensor | None,
        lengths: list[int],
        widths: list[int],
        eos: int,
    ) -> None:
        self.fetched = (tokens, cumulative, eos_cumulative, scores, attention)
        self.lengths, self.widths, self.eos = lengths, widths, eos
        self._rows: list[tuple[Tensor, ...]] | None = None  # per row, once one is asked for

    def hypothesis(self, row: int) -> Hypothesis:
        """Row ``row`` as fairseq's hypothesis: its tokens and EOS, its score, its positional
        scores and its attention (empty without)."""
        if self._rows is None:
            self._rows = self._per_row()
        tokens, positional, score, *attention = self._rows[row]
        own = slice(-self.lengths[row], None)  # the columns of longer rows come first
        return {
            "tokens": tokens[own],
            "score": score,
            "attention": attention[0][-self.widths[row] :, own] if attention else torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": positional[own],
        }

    def _per_row(self) -> list[tuple[Tensor, ...]]:
        """Each row's tokens with EOS, positional scores, score and attention: views of tensors
        made for all rows at once."""
        tokens, cumulative, eos_cumulative, scores, attention = self.fetched
        # Returned tensors must be ordinary ones: callers change them in place (fairseq-generate
        # divides the positional scores by log 2). Made outside inference mode, new tensors are.
        with torch.inference_mode(False):
            tokens = F.pad(tokens, (0, 1), value=self.eos)
            cumulative = torch.cat([cumulative, eos_cumulative.unsqueeze(1)], 1)
            # A row's own columns are its last `length`; the one before them is the score 0 its
            # sentence joined with (or the 0 prepended): differences are its positional scores.
            positional = cumulative.diff(dim=1, prepend=cumulative.new_zeros(len(scores), 1))
            made = [tokens, positional, scores.clone()]
            if attention is not None:
                made.append(attention.clone())
            return list(zip(*(t.unbind() for t in made), strict=True))

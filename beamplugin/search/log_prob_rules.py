"""fairseq's per-step rules on the next-token log-probs, for sentences at any step.

Each sentence in flight has its own step, maximum length and forced prefix, so a rule applies to
the rows of the sentences it concerns: all rows when every sentence is in the same state (one
batch decoded from the start, as in fairseq), a subset when sentences joined at different
times. In order: pad and suppressed tokens, EOS before ``min_len`` (except on forced-prefix
steps), the unk penalty, only EOS at the maximum length, the forced prefix, no repeated
n-grams, and the per-sentence length bounds of fairseq's LengthConstrainedBeamSearch.

The rules see a step through :class:`StepView` (as vLLM's logits processors see
``SamplingMetadata``), never the engine: a new rule reads what it needs from the view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from beamplugin.runtime.host_transfer import to_device
from beamplugin.search.beam_step import block_repeated_ngrams
from beamplugin.search.options import DecodingOptions


class RowLayout(Protocol):
    """Which decoder rows belong to which sentence this step (sentence-major)."""

    def rows_of(self, sentences: list[int]) -> Tensor | None:
        """The rows of sentences ``sentences`` (None: of all sentences)."""

    def first_rows(self) -> Tensor:
        """``[sentences]`` each sentence's first row."""

    def row_sentences(self) -> Tensor:
        """``[rows]`` each row's sentence."""

    def steps_on_device(self) -> Tensor:
        """``[sentences]`` each sentence's step, on the device."""


class StepView(NamedTuple):
    """What the rules see of one step: per sentence its state, per row its history."""

    tokens: Tensor  # [rows, steps + 1] each row's tokens, BOS first, left-padded
    steps: list[int]  # per sentence: output tokens it has
    max_lens: list[int]  # per sentence: output tokens before EOS is forced
    prefix_lens: list[int]  # per sentence: steps its forced prefix covers
    prefix_ends: list[int]  # per sentence: step at which its prefix forces EOS, -1 if none
    layout: RowLayout
    # per sentence, on the device: "prefix" [sentences, p] (pad: free choice), "min_lens" and
    # "max_lens" (length constraints)
    per_sentence: Mapping[str, Tensor]


class LogProbRules:
    def __init__(self, options: DecodingOptions) -> None:
        self.options = options
        self.pad, self.eos, self.unk = options.pad, options.eos, options.unk
        # Tokens set to -inf (fairseq's rules): pad on every row; suppressed tokens, and before
        # min_len EOS, on steps without a forced prefix token. Masked on all rows at once where
        # the rule holds for every sentence (always for pad).
        self.columns = {
            "all": [self.pad],
            "unforced": list(options.suppressed),
            "short": [self.eos],
        }
        self._on_device: dict[tuple[str, torch.device], Tensor] = {}

    def _columns(self, kind: str, device: torch.device) -> Tensor:
        key = (kind, device)
        if key not in self._on_device:
            self._on_device[key] = to_device(self.columns[kind], device)
        return self._on_device[key]

    def apply(self, lprobs: Tensor, view: StepView) -> tuple[Tensor, Tensor | None]:
        """The masked log-probs ``[rows, vocab]`` and, on a step where a forced prefix ends in
        EOS for some sentence, the row each row must become a copy of (else None)."""
        options, steps, max_lens = self.options, view.steps, view.max_lens
        n = len(steps)
        final = [i for i in range(n) if steps[i] >= max_lens[i]]
        in_prefix = [
            i for i in range(n) if steps[i] < view.prefix_lens[i] and steps[i] < max_lens[i]
        ]
        forced = set(in_prefix)
        unforced = [i for i in range(n) if i not in forced] if options.suppressed else []
        short = []
        if min(steps) < options.min_len:
            short = [i for i in range(n) if steps[i] < options.min_len and i not in forced]
        lprobs.index_fill_(1, self._columns("all", lprobs.device), -math.inf)
        for kind, sentences in (("unforced", unforced), ("short", short)):
            if sentences:
                columns = self._columns(kind, lprobs.device)
                rows = view.layout.rows_of(sentences)
                if rows is None:
                    lprobs.index_fill_(1, columns, -math.inf)
                else:
                    lprobs[rows.unsqueeze(1), columns.unsqueeze(0)] = -math.inf
        if options.unk_penalty:
            lprobs[:, self.unk] -= options.unk_penalty
        if final:  # only EOS is left
            rows = view.layout.rows_of(final)
            selected = slice(None) if rows is None else rows
            eos_lprobs = lprobs[selected, self.eos].clone()
            if rows is None:
                lprobs.fill_(-math.inf)
            else:
                lprobs.index_fill_(0, rows, -math.inf)
            lprobs[selected, self.eos] = eos_lprobs
        copies = None
        if in_prefix:
            lprobs, copies = self._force_prefix(lprobs, view, in_prefix)
        if options.no_repeat_ngram_size > 0:
            block_repeated_ngrams(view.tokens, lprobs, options.no_repeat_ngram_size, self.pad)
        if options.length_constraints is not None:
            on_device = view.layout.steps_on_device()
            bounds = view.per_sentence
            each_row = view.layout.row_sentences()
            eos_lprobs = lprobs[:, self.eos]  # a view: filled in place
            eos_lprobs.masked_fill_((on_device < bounds["min_lens"])[each_row], -math.inf)
            eos_lprobs.masked_fill_((on_device >= bounds["max_lens"])[each_row], 0.0)
        return lprobs, copies

    def _force_prefix(
        self, lprobs: Tensor, view: StepView, in_prefix: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """Keep only the prefix token where one is given (pad = free choice at this step)."""
        each_row = view.layout.row_sentences()
        prefix = view.per_sentence["prefix"]
        steps = view.layout.steps_on_device().clamp(max=prefix.size(1) - 1)
        forced = prefix.gather(1, steps.unsqueeze(1)).squeeze(1)
        if len(in_prefix) < len(view.steps):
            inside = set(in_prefix)
            outside = [i for i in range(len(view.steps)) if i not in inside]
            forced = forced.index_fill(0, to_device(outside, lprobs.device), self.pad)
        forced = forced[each_row].unsqueeze(1)
        only_forced = torch.full_like(lprobs, -math.inf).scatter_(
            1, forced, lprobs.gather(1, forced)
        )
        lprobs = torch.where(forced.ne(self.pad), only_forced, lprobs)
        if not any(s == end for s, end in zip(view.steps, view.prefix_ends, strict=True)):
            return lprobs, None
        # A prefix that ends here: all beams become copies of beam 0 (the only one that
        # followed the prefix), as in fairseq; attention stays per row as fairseq's does.
        rows = torch.arange(lprobs.size(0), device=lprobs.device)
        first = view.layout.first_rows()[each_row]
        source = torch.where(forced.squeeze(1).eq(self.eos), first, rows)
        return lprobs.index_select(0, source), source

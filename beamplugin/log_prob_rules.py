"""fairseq's per-step rules on the next-token log-probs, for sentences at any step.

Each sentence in flight has its own step, maximum length and forced prefix, so a rule applies to
the rows of the sentences it concerns: all rows when every sentence is in the same state (one
batch decoded from the start, as in fairseq), a subset when sentences joined at different
times. In order: pad and suppressed tokens, EOS before ``min_len`` (except on forced-prefix
steps), the unk penalty, only EOS at the maximum length, the forced prefix, no repeated
n-grams, and the per-sentence length bounds of fairseq's LengthConstrainedBeamSearch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from beamplugin.host_transfer import to_device
from beamplugin.search import block_repeated_ngrams

if TYPE_CHECKING:
    from beamplugin.engine import DecodingEngine
    from beamplugin.sequence_generator import SequenceGenerator


class LogProbRules:
    def __init__(self, gen: SequenceGenerator) -> None:
        self.gen = gen
        self.pad, self.eos, self.unk = gen.pad, gen.eos, gen.unk
        # Tokens set to -inf (fairseq's rules): pad on every row; suppressed tokens, and before
        # min_len EOS, on steps without a forced prefix token. Masked on all rows at once where
        # the rule holds for every sentence (always for pad).
        self.columns = {
            "all": [self.pad],
            "unforced": gen.suppressed,
            "short": [self.eos],
        }
        self._on_device: dict[tuple[str, torch.device], Tensor] = {}

    def _columns(self, kind: str, device: torch.device) -> Tensor:
        key = (kind, device)
        if key not in self._on_device:
            self._on_device[key] = to_device(self.columns[kind], device)
        return self._on_device[key]

    def apply(self, lprobs: Tensor, engine: DecodingEngine) -> tuple[Tensor, Tensor | None]:
        """The masked log-probs ``[rows, vocab]`` and, on a step where a forced prefix ends in
        EOS for some sentence, the row each row must become a copy of (else None)."""
        gen, live = self.gen, engine.live
        n = len(live)
        if gen.lm_model is not None:
            lm_out = gen.lm_model(engine.tokens)
            lm_lprobs = gen.lm_model.get_normalized_probs(lm_out, log_probs=True, sample=None)
            lprobs = lprobs + lm_lprobs[:, -1, :] * gen.lm_weight
        final = [i for i, s in enumerate(live) if s.step >= s.max_len]
        in_prefix = [
            i for i, s in enumerate(live) if s.step < s.prefix_len and s.step < s.max_len
        ]
        forced = set(in_prefix)
        unforced = [i for i in range(n) if i not in forced] if gen.suppressed else []
        short = []
        if min(s.step for s in live) < gen.min_len:
            short = [i for i, s in enumerate(live) if s.step < gen.min_len and i not in forced]
        kinds = {"all": range(n), "unforced": unforced, "short": short}
        for kind, sentences in kinds.items():
            if sentences:
                columns = self._columns(kind, lprobs.device)
                rows = engine.rows_of(sentences)
                if rows is None:
                    lprobs.index_fill_(1, columns, -math.inf)
                else:
                    lprobs[rows.unsqueeze(1), columns.unsqueeze(0)] = -math.inf
        if gen.unk_penalty:
            lprobs[:, self.unk] -= gen.unk_penalty
        if final:  # only EOS is left
            rows = engine.rows_of(final)
            selected = slice(None) if rows is None else rows
            eos_lprobs = lprobs[selected, self.eos].clone()
            if rows is None:
                lprobs.fill_(-math.inf)
            else:
                lprobs.index_fill_(0, rows, -math.inf)
            lprobs[selected, self.eos] = eos_lprobs
        copies = None
        if in_prefix:
            lprobs, copies = self._force_prefix(lprobs, engine, in_prefix)
        if gen.no_repeat_ngram_size > 0:
            block_repeated_ngrams(engine.tokens, lprobs, gen.no_repeat_ngram_size, self.pad)
        if gen.length_constraints is not None:
            steps = engine.steps_on_device()
            bounds = engine.per_sentence
            each_row = engine.row_sentences()
            eos_lprobs = lprobs[:, self.eos]  # a view: filled in place
            eos_lprobs.masked_fill_((steps < bounds["min_lens"])[each_row], -math.inf)
            eos_lprobs.masked_fill_((steps >= bounds["max_lens"])[each_row], 0.0)
        return lprobs, copies

    def _force_prefix(
        self, lprobs: Tensor, engine: DecodingEngine, in_prefix: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """Keep only the prefix token where one is given (pad = free choice at this step)."""
        live, each_row = engine.live, engine.row_sentences()
        prefix = engine.per_sentence["prefix"]
        steps = engine.steps_on_device().clamp(max=prefix.size(1) - 1)
        forced = prefix.gather(1, steps.unsqueeze(1)).squeeze(1)
        if len(in_prefix) < len(live):
            outside = [i for i in range(len(live)) if i not in set(in_prefix)]
            forced = forced.index_fill(0, to_device(outside, lprobs.device), self.pad)
        forced = forced[each_row].unsqueeze(1)
        only_forced = torch.full_like(lprobs, -math.inf).scatter_(
            1, forced, lprobs.gather(1, forced)
        )
        lprobs = torch.where(forced.ne(self.pad), only_forced, lprobs)
        if not any(s.step == s.prefix_end for s in live):
            return lprobs, None
        # A prefix that ends here: all beams become copies of beam 0 (the only one that
        # followed the prefix), as in fairseq; attention stays per row as fairseq's does.
        rows = torch.arange(lprobs.size(0), device=lprobs.device)
        first = engine.first_rows()[each_row]
        source = torch.where(forced.squeeze(1).eq(self.eos), first, rows)
        return lprobs.index_select(0, source), source

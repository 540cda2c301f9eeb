"""After the search step: which hypotheses end, into each sentence's n-best, which sentences
are done, and their results.

:meth:`Finalizer.status` is the one host synchronisation of a step; only on a step where some
hypothesis ends (or a sentence reaches its maximum length) does :meth:`Finalizer.finish` run,
with one more (the hypotheses' tensors fetched at once).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from fairseq import utils
from torch import Tensor

from beamplugin.engine.model_runner import ModelRunner
from beamplugin.engine.requests import Finished
from beamplugin.engine.slots import Sentence, Slots
from beamplugin.runtime.host_transfer import to_device, to_host
from beamplugin.search.beam_step import BeamStep, length_normaliser
from beamplugin.search.hypotheses import EndedRows
from beamplugin.search.nbest import Hypothesis
from beamplugin.search.options import DecodingOptions
from beamplugin.search.stopping import best_possible


class StepStatus(NamedTuple):
    """A step's search result as the host needs it (fetched with one synchronisation)."""

    ending: Tensor  # [sentences, slots] which of the top beam candidates end in EOS
    # some candidate ends, or (exact stopping) some sentence's live hypotheses cannot beat its
    # worst finished one: the finalizer has work
    acts: bool
    # the best candidate is NaN somewhere (a NaN log-prob ranks first): fairseq's rule makes
    # NaN log-probs -inf, and the step is searched again
    nan: bool
    bound: Tensor | None  # exact stopping: the best final score each sentence can reach


class Finalizer:
    def __init__(self, options: DecodingOptions) -> None:
        self.options = options
        self.beam = options.beam_size

    def status(self, res: BeamStep, slots: Slots) -> StepStatus:
        """What the step's search means for its sentences, on the host (see StepStatus)."""
        columns, bound = [res.finalize], None
        if res.first_nan is not None:
            columns.append(res.first_nan)
        if self.options.stopping == "exact":
            live = slots.live
            bound = best_possible(
                res.alive_scores[:, 0], [s.step for s in live], [s.max_len for s in live],
                self.options,
            )  # fmt: skip
            columns.append(bound.le(slots.per_sentence["worst"]).unsqueeze(1))
        if len(columns) == 1:  # the ending candidates say it all
            (ending,) = to_host(res.finalize)
            return StepStatus(ending, bool(ending.any()), False, None)
        if bound is None:
            (status,) = to_host(torch.cat(columns, 1))
        else:
            status, bound = to_host(torch.cat(columns, 1), bound)
        slots_ = res.finalize.size(1)  # beam, or fewer with a tiny vocabulary
        nan = res.first_nan is not None and bool(status[:, slots_].any())
        return StepStatus(status[:, :slots_], bool(status.any()), nan, bound)

    def finish(
        self,
        res: BeamStep,
        finalize: Tensor,
        bound: Tensor | None,
        lprobs: Tensor,
        attn: Tensor | None,
        slots: Slots,
        runner: ModelRunner,
    ) -> list[bool]:
        """Store the hypotheses that end now (``finalize``: the host copy of res.finalize) and
        return, per live sentence, whether it is done."""
        beam, live = self.beam, slots.live
        sents, slots_ = finalize.nonzero(as_tuple=True)
        if len(sents):
            sents_dev, cands = to_device(
                torch.stack([sents, sents * res.cand_beams.size(1) + slots_]), slots.device
            )
            rows = slots.first_rows().index_select(0, sents_dev)
            rows = rows + res.cand_beams.view(-1).index_select(0, cands)
            eos_scores = res.cand_scores.view(-1).index_select(0, cands)
            self._store(sents.tolist(), sents_dev, rows, eos_scores, attn, slots, runner)
        counts = [len(s.nbest) for s in live]
        at_max = [s.step >= s.max_len for s in live]
        if self.options.stopping == "fairseq":
            done = [m or c >= beam for m, c in zip(at_max, counts, strict=True)]
        else:
            worst = torch.tensor([s.nbest.worst_score() for s in live])
            slots.per_sentence["worst"] = to_device(worst.to(bound.dtype), slots.device)
            done = [m or b for m, b in zip(at_max, bound.le(worst).tolist(), strict=True)]
        empty = [i for i, d in enumerate(done) if d and counts[i] == 0 and live[i].error is None]
        if empty:
            # Nothing reached EOS: the live hypotheses, with EOS appended, are the answer
            # (beam of them, as in fairseq, even at the first step where all are the same).
            sents = torch.tensor(empty).repeat_interleave(beam)
            hypos = torch.arange(beam).repeat(len(empty))
            # a sentence at its first step has one row, one hypothesis, score 0
            own = hypos.masked_fill(sents >= len(live) - slots.one_row, 0)
            sents_dev, own_dev = to_device(torch.stack([sents, own]), slots.device)
            rows = slots.first_rows().index_select(0, sents_dev) + own_dev
            scores = F.pad(runner.scores, (0, 0, 0, slots.one_row))
            eos_lprobs = lprobs[rows, self.options.eos]
            cumulative = scores[sents_dev, own_dev % scores.size(1)] + eos_lprobs
            self._store(sents.tolist(), sents_dev, rows, cumulative, attn, slots, runner)
        return done

    def _store(
        self,
        sents: list[int],
        sents_dev: Tensor,
        rows: Tensor,
        eos_cumulative: Tensor,
        attn: Tensor | None,
        slots: Slots,
        runner: ModelRunner,
    ) -> None:
        """Give the n-best keepers of sentences ``sents`` (``sents_dev`` the same on the device)
        the hypotheses of rows ``rows`` followed by EOS."""
        options, live = self.options, slots.live
        lengths = [live[s].step + 1 for s in sents]  # tokens, EOS included
        tokens, cumulative = runner.history(rows)
        scores = eos_cumulative
        if options.normalize_scores:
            divisors = [
                length_normaliser(n, options.len_penalty, options.length_penalty_style)
                for n in lengths
            ]
            if len(set(lengths)) == 1:  # one length (always, batch after batch): a number
                scores = scores / divisors[0]
            else:
                scores = scores / to_device(divisors, slots.device, scores.dtype)
        if options.match_source_len:
            src_lengths = slots.per_sentence["src_lengths"].index_select(0, sents_dev)
            too_long = to_device(lengths, slots.device) > src_lengths + 1
            scores = scores.masked_fill(too_long, -math.inf)
        fetched = [tokens, cumulative, eos_cumulative, scores]
        if attn is not None:
            fetched.append(runner.attention_history(rows, attn).transpose(1, 2))
        tokens, cumulative, eos_cumulative, scores, *attention = to_host(*fetched)
        ended = EndedRows(
            tokens, cumulative, eos_cumulative, scores, attention[0] if attention else None,
            lengths, [live[s].width for s in sents], options.eos,
        )  # fmt: skip
        for row, (sent, score) in enumerate(zip(sents, scores.tolist(), strict=True)):
            live[sent].nbest.add(score, (ended, row))

    def result(self, sentence: Sentence) -> Finished:
        """A done sentence's hypotheses, best first."""
        if sentence.error is not None:
            return Finished(sentence.key, [], sentence.error)
        hypotheses = [
            ended.hypothesis(row) for ended, row in sentence.nbest.best_first(self.options.nbest)
        ]
        if self.options.print_alignment:
            add_alignments(hypotheses, sentence.src_tokens, self.options)
        return Finished(sentence.key, hypotheses)


def add_alignments(
    hypotheses: list[Hypothesis], src_tokens: Tensor, options: DecodingOptions
) -> None:
    """Fill each hypothesis' ``alignment`` from its attention over ``src_tokens``, as fairseq's
    ``SequenceGeneratorWithAlignment`` does (hard or soft)."""
    extract = (
        utils.extract_hard_alignment
        if options.print_alignment == "hard"
        else utils.extract_soft_alignment
    )
    src_tokens = src_tokens.cpu()
    for hypo in hypotheses:
        if hypo["attention"].numel() == 0:
            raise ValueError(
                "print_alignment needs a model that returns attention (for fconv, "
                "prepare it with make_generation_fast_(need_attn=True))"
            )
        hypo["alignment"] = extract(
            hypo["attention"].t(), src_tokens, hypo["tokens"], options.pad, options.eos
        )

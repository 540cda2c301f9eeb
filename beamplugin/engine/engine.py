"""The decoding engine: beam search over the sentences in flight, one decoder forward per step
for all of them, new sentences joining while others are mid-search (continuous batching).

A step reads as its parts: the scheduler admits waiting requests into free slots (between
steps, :meth:`DecodingEngine.admit_waiting`), the model runner moves the decoder rows and runs
the decoder, the log-prob rules mask its output, the beam step picks candidates, the finalizer
keeps the hypotheses that end and says who is done, and the done sentences free their slots.

Sentences at different steps share a forward only when every model mixes steps (see
beamplugin.engine.ensemble); otherwise new sentences are admitted when the engine is empty,
which is fairseq's batch-at-a-time decoding. A sentence's own state is all it depends on: its
results are those it gets when decoded alone, whoever shares its steps.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.engine.finalizer import Finalizer, StepStatus
from beamplugin.engine.model_runner import ModelRunner, Pending
from beamplugin.engine.requests import Finished, Request
from beamplugin.engine.scheduler import Scheduler, Waiting
from beamplugin.engine.slots import Sentence, Slots
from beamplugin.runtime.collector import freeze_startup_objects
from beamplugin.runtime.heap import keep_freed_memory
from beamplugin.search.beam_step import BeamStep, candidates_per_row, step_laid_out, with_rows
from beamplugin.search.constraints import ConstrainedSentence, Progress, constrained_step
from beamplugin.search.log_prob_rules import LogProbRules
from beamplugin.search.options import DecodingOptions

logger = logging.getLogger(__name__)


class Decoder(Protocol):
    """What an engine decodes with (beamplugin's SequenceGenerator is one)."""

    model: EnsembleDecoder
    options: DecodingOptions


class DecodingEngine:
    """Beam search with ``options`` over ``model``, bounded by ``max_sentences`` sentences and
    ``max_tokens`` (each sentence counts beam x its source width) in flight; ``None``:
    unbounded. Hypotheses start with ``bos_token`` (default: EOS, as in fairseq)."""

    def __init__(
        self,
        model: EnsembleDecoder,
        options: DecodingOptions,
        max_sentences: int | None = None,
        max_tokens: int | None = None,
        bos_token: int | None = None,
    ) -> None:
        keep_freed_memory()  # steps allocate the same sizes again and again
        freeze_startup_objects()  # full collections then skip what was loaded before
        self.options = options
        self.scheduler = Scheduler(model, options, max_sentences, max_tokens)
        self.slots = Slots(model, options)
        bos = options.eos if bos_token is None else bos_token
        self.runner = ModelRunner(model, options, bos)
        self.rules = LogProbRules(options)
        self.finalizer = Finalizer(options)
        self._pending: Pending | None = None  # last step's result, applied by the next
        self.refills = 0  # sentences admitted while others were mid-search
        self.steps = 0  # decoder steps taken
        self.cancelled = 0  # sentences cancelled, waiting or in flight
        self._cancelling = False  # some sentence in flight is to leave at the next step
        if not model.mixes_steps and (max_sentences or max_tokens):
            logger.info(
                "these models cannot decode sentences at different steps in one forward (%s): "
                "new sentences are admitted when the batch is empty (no continuous batching)",
                model.why_not_mixed,
            )

    @classmethod
    def of(cls, decoder: Decoder, max_sentences: int | None = None,
           max_tokens: int | None = None, bos_token: int | None = None) -> DecodingEngine:
        """An engine decoding with ``decoder``'s model and options."""
        return cls(decoder.model, decoder.options, max_sentences, max_tokens, bos_token)

    @property
    def live(self) -> list[Sentence]:
        """The sentences in flight, in their slots."""
        return self.slots.live

    @property
    def waiting(self) -> deque[Waiting]:
        """Checked requests not in flight yet."""
        return self.scheduler.waiting

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing waiting."""
        return not self.live and not self.waiting

    # ---- admission (between steps) ---------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` can never be decoded here; else set its max_len."""
        self.scheduler.check(request)

    def wants_requests(self) -> bool:
        return self.scheduler.wants_requests(len(self.live))

    def enqueue(self, request: Request) -> None:
        """Let ``request`` (checked) wait for room."""
        self.scheduler.enqueue(request, self.steps)

    def admit_waiting(self, more_coming: bool = False) -> None:
        """Put the waiting requests that fit in flight, encoded first. ``more_coming``: more
        requests may arrive soon, so a few may wait a little to be encoded together."""
        admission = self.scheduler.schedule(
            len(self.live), self.slots.tokens_in_flight, self.steps, more_coming
        )
        if admission is None:
            return
        self.runner.encode(admission.to_encode)
        mid_search = bool(self.live) and self._pending is not None
        sentences = self.slots.allocate(admission.admitted)
        if mid_search:
            self.refills += len(sentences)

    def cancel(self, keys: Iterable[Any]) -> None:
        """Drop the sentences of ``keys`` (from the engine's thread, between steps): those
        waiting at once, those in flight at the end of the next step, their slots freed with
        the finished ones'; none of them comes back as a result."""
        keys = set(keys)
        self.cancelled += self.scheduler.cancel(keys)
        for sentence in self.live:
            if sentence.key in keys and not sentence.cancelled:
                sentence.cancelled = self._cancelling = True

    # ---- a step ------------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One decoder forward and search step for every sentence in flight; returns the
        sentences that finished in it."""
        if not self.live:
            return []
        self.steps += 1
        self.runner.advance(self.slots, self._pending)
        lprobs, attn = self.runner.forward(self.slots)
        lprobs, copies = self.rules.apply(lprobs, self.slots.view(self.runner.tokens))
        if copies is not None:
            self.runner.copy_rows(copies)
        last_step = self._at_max_len()  # once a step: the search's and the finish check's
        res, status, constrained = self._search(lprobs, last_step)
        if status.nan:  # fairseq's rule: NaN log-probs become -inf (rare, so only redone here)
            lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            res, status, constrained = self._search(lprobs, last_step)
        for index, states in constrained:
            sentence = self.live[index]
            sentence.constraints = states
            if sentence.step >= sentence.max_len and not status.ending[index].any():
                # fairseq's generator fails its whole batch here (an assertion)
                sentence.error = ValueError(
                    f"the lexical constraints were not all met within the maximum output "
                    f"length of {sentence.max_len} tokens"
                )
        done: list[bool] | None = None
        if status.acts or last_step is not None:
            done = self.finalizer.finish(
                res, status.ending, status.bound, lprobs, attn, self.slots, self.runner
            )
        if self._cancelling:
            done = self._with_cancelled(done)
        finished = [
            self.finalizer.result(s)
            for s, d in zip(self.live, done or (), strict=False)
            if d and not s.cancelled
        ]
        order = self.slots.free(done)
        self._pending = Pending(res, attn, order) if self.live else None
        if not self.live:
            self.runner.release()
        return finished

    def _with_cancelled(self, done: list[bool] | None) -> list[bool]:
        """``done`` with the cancelled sentences done too (they leave now)."""
        self._cancelling = False
        cancelled = [s.cancelled for s in self.live]
        self.cancelled += sum(cancelled)
        return [c or bool(d) for c, d in zip(cancelled, done or cancelled, strict=True)]

    def _search(
        self, lprobs: Tensor, last_step: Tensor | None
    ) -> tuple[BeamStep, StepStatus, list[tuple[int, Progress]]]:
        """The beam step of every live sentence and its status on the host (the step's one
        synchronisation, but for sentences with lexical constraints); with the constraint
        states of their next beams, by live sentence (``last_step``: :meth:`_at_max_len`)."""
        slots, options = self.slots, self.options
        multi = len(slots.live) - slots.one_row
        beam, eos = options.beam_size, options.eos
        constrained = self._constrained(lprobs, multi)
        if constrained and len(constrained) == len(slots.live):  # no plain step to run
            hypotheses = self.runner.scores.size(1) if multi else 1
            k = candidates_per_row(beam, hypotheses, lprobs.size(1))
            res, states = constrained_step(constrained, k, beam, eos)
        else:
            res = step_laid_out(lprobs, self.runner.scores, multi, slots.one_row, beam, eos,
                                last_step)  # fmt: skip
            if not constrained:
                return res, self.finalizer.status(res, slots), []
            step, states = constrained_step(constrained, res.cand_scores.size(1), beam, eos)
            res = with_rows(res, [c.index for c in constrained], step)
        next_states = [(c.index, own) for c, own in zip(constrained, states, strict=True)]
        return res, self.finalizer.status(res, slots), next_states

    def _at_max_len(self) -> Tensor | None:
        """Which live sentences take their last step now (None where none does)."""
        last = [s.step >= s.max_len for s in self.live]
        return torch.tensor(last) if any(last) else None

    def _constrained(self, lprobs: Tensor, multi: int) -> list[ConstrainedSentence]:
        """The live sentences with lexical constraints, as their constrained step reads them
        (``multi``: the sentences with beam rows)."""
        beam = self.options.beam_size
        sentences: list[ConstrainedSentence] = []
        if self.options.constraints is None:  # no sentence can have any
            return sentences
        for index, sentence in enumerate(self.live):
            if sentence.constraints is None:
                continue
            first = index * beam if index < multi else multi * beam + index - multi
            if sentence.step == 0:  # its hypotheses are all the same: one row, no score yet
                rows, scores = lprobs[first : first + 1], None
            else:
                rows, scores = lprobs[first : first + beam], self.runner.scores[index]
            sentences.append(ConstrainedSentence(index, rows, scores, sentence.constraints))
        return sentences

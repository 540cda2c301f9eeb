"""The device engine: continuous batching with the whole step on the device
(beamplugin.engine.fixed_rows), each sentence in fixed rows for its life, and the host one step
behind the device.

The host enqueues step ``k`` (a CUDA graph of its bucket), then reads the status of step
``k - 1`` (which slots' searches ended: one copy, made without waiting, into pinned memory) while
the device runs step ``k``; it retires the sentences that ended (their n-best rows copied out
the same way, made into results at the next step), moves the last sentences into the holes so
that the bucket shrinks, and admits new ones into free slots for step ``k + 1``. The device
knows which sentences ended before the host does, so nothing it runs for a retired sentence
touches what the host reads. The same code runs on the CPU (no graphs, copies that need no
wait), where tests check it against the engine of beamplugin.engine.engine.

What it serves: one fairseq transformer or convs2s, fairseq's stopping and per-step rules, forced
prefixes (beamplugin.search.fixed_rows_step.unsupported says what it leaves to the other
engine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.engine.fixed_rows import (
    LEAST_COLUMNS,
    Bucket,
    EndedRows,
    FixedRows,
    HostCopy,
    bucket,
    fixed_rows_for,
    serves,
)
from beamplugin.engine.model_runner import encode
from beamplugin.engine.requests import Finished, Request
from beamplugin.engine.scheduler import Scheduler, Waiting
from beamplugin.runtime.collector import freeze_startup_objects
from beamplugin.search.fixed_rows_step import unsupported
from beamplugin.search.nbest import Hypothesis, NBest
from beamplugin.search.options import DecodingOptions


def why_not(model: EnsembleDecoder, options: DecodingOptions) -> str | None:
    """Why the device engine cannot decode ``model`` with ``options`` (None: it can)."""
    if len(model.models) != 1 or model.lm_model is not None:
        return "an ensemble or a language model"
    if not model.mixes_steps or not serves(model.models[0]):
        return "a model other than fairseq's transformer and our convs2s"
    return unsupported(options)


@dataclass(eq=False)
class Resident:
    """Host-side record of a sentence in flight on the device."""

    key: Any
    slot: int
    width: int  # source positions it reads
    max_len: int
    step: int = 0  # steps enqueued for it: its output tokens, until its search ends
    retired: bool = False  # its search ended (or it was cancelled): its slot is free
    cancelled: bool = False


class DeviceEngine:
    """Beam search with ``options`` over ``model`` on fixed rows (see the module's text): the
    interface of beamplugin.engine.engine.DecodingEngine, with ``graphs``: CUDA graphs where
    the device is a GPU."""

    def __init__(
        self, model: EnsembleDecoder, options: DecodingOptions, max_sentences: int | None = None,
        max_tokens: int | None = None, bos_token: int | None = None, graphs: bool = True,
    ) -> None:  # fmt: skip
        reason = why_not(model, options)
        if reason is not None:
            raise ValueError(f"the device engine does not decode {reason}")
        freeze_startup_objects()
        self.model, self.options = model, options
        self.beam = options.beam_size
        self.scheduler = Scheduler(model, options, max_sentences, max_tokens)
        self.max_sentences = max_sentences
        self.bos = options.eos if bos_token is None else bos_token
        self.graphs = graphs
        self.rows: FixedRows | None = None
        self.occupants: list[Resident | None] = []  # per slot
        self._residents: list[Resident] = []  # in flight, or retired and not yet returned
        self._statuses: deque[tuple[list[Resident | None], HostCopy]] = deque()
        self._deliveries: deque[tuple[list[Resident], HostCopy]] = deque()
        self.refills = 0  # sentences admitted while others were mid-search
        self.steps = 0  # decoder steps taken
        self.cancelled = 0

    @property
    def live(self) -> list[Resident]:
        """The sentences in flight, and those whose results are on their way."""
        return self._residents

    @property
    def waiting(self) -> deque[Waiting]:
        return self.scheduler.waiting

    @property
    def idle(self) -> bool:
        return not self._residents and not self.waiting

    def _in_flight(self) -> list[Resident]:
        return [s for s in self.occupants if s is not None]

    # ---- admission (between steps) ---------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` can never be decoded here; else set its max_len."""
        self.scheduler.check(request)

    def wants_requests(self) -> bool:
        return self.scheduler.wants_requests(len(self._in_flight()))

    def enqueue(self, request: Request) -> None:
        self.scheduler.enqueue(request, self.steps)

    def admit_waiting(self, more_coming: bool = False) -> None:
        """Encode the waiting requests that fit and put them into free slots."""
        in_flight = self._in_flight()
        tokens = sum(self.beam * s.width for s in in_flight)
        admission = self.scheduler.schedule(len(in_flight), tokens, self.steps, more_coming)
        if admission is None:
            return
        requests = [item.request for item in admission.admitted]
        device = requests[0].src_tokens.device
        if self.rows is None:
            self.rows = fixed_rows_for(self.model, self.options, device, self.graphs)
        rows = self.rows
        count = len(in_flight) + sum(len(r.keys) for r in requests)
        if rows.stream is not None:  # the requests' tensors were made on the caller's stream
            rows.stream.wait_stream(torch.cuda.current_stream(device))
        with rows.streamed():
            rows.reserve(
                max(count, self.max_sentences or 0),
                max(r.max_len for r in requests) + 1,
                max(r.width for r in requests),
                max(0 if r.prefix_tokens is None else r.prefix_tokens.size(1) for r in requests),
            )
            self._grow_occupants()
            encode(self.model, self.options, admission.to_encode)
            mid_search = bool(in_flight)
            for item in admission.admitted:
                self._place(item)
                item.release()
                if mid_search:
                    self.refills += len(item.request.keys)

    def _place(self, item: Waiting) -> None:
        """The sentences of an encoded request into the lowest free slots."""
        request = item.request
        free = [i for i, s in enumerate(self.occupants) if s is None][: len(request.keys)]
        outs, rows = item.encoded
        bos = self.bos if request.bos is None else request.bos
        self.rows.admit(free, outs[0], rows.start, [request.max_len] * len(free),
                        [bos] * len(free), request.prefix_tokens)  # fmt: skip
        for slot, key in zip(free, request.keys, strict=True):
            resident = Resident(key, slot, request.width, request.max_len)
            self.occupants[slot] = resident
            self._residents.append(resident)

    def _grow_occupants(self) -> None:
        missing = self.rows.capacity.slots - len(self.occupants)
        self.occupants.extend([None] * missing)

    def cancel(self, keys: Iterable[Any]) -> None:
        """Drop the sentences of ``keys``: those waiting at once, those in flight at the next
        step; none of them comes back as a result."""
        keys = set(keys)
        self.cancelled += self.scheduler.cancel(keys)
        for resident in self._in_flight():
            if resident.key in keys:
                resident.cancelled = True

    # ---- a step ------------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """Enqueue a step of every sentence in flight, and read the last one's status: returns
        the sentences whose results have come back."""
        rows = self.rows
        if rows is None:
            return []
        with rows.streamed():
            in_flight = self._in_flight()
            if in_flight:
                self.steps += 1
                size = self._bucket(in_flight)
                snapshot = self.occupants[: size.slots]
                rows.step(size)
                for resident in in_flight:
                    resident.step += 1
                self._statuses.append((snapshot, rows.done_flags()))
            finished = self._deliver()
            while len(self._statuses) > (1 if in_flight else 0):
                self._retire(*self._statuses.popleft())
            self._retire_cancelled()
            self._compact()
        return finished

    def _bucket(self, in_flight: list[Resident]) -> Bucket:
        capacity = self.rows.capacity
        slots = bucket(1 + max(s.slot for s in in_flight))
        columns = bucket(1 + max(min(s.step, s.max_len) for s in in_flight), LEAST_COLUMNS)
        # every source position the capacity holds: fewer graphs, and the cross-attention's
        # extra masked columns cost little beside a graph captured for each width
        return Bucket(slots, min(columns, capacity.columns), capacity.sources)

    def _retire(self, snapshot: list[Resident | None], status: HostCopy) -> None:
        """Free the slots of the sentences whose search ended by the step of ``status``
        (``snapshot``: who was in each slot then) and copy their n-best rows out."""
        (done,) = status.ready()
        ended = [
            s for s, d in zip(snapshot, done.tolist(), strict=False)
            if s is not None and d and not s.retired
        ]  # fmt: skip
        if not ended:
            return
        for resident in ended:
            resident.retired = True
            self.occupants[resident.slot] = None
        columns = max(s.max_len for s in ended) + 1
        copy = self.rows.ended([s.slot for s in ended], columns)
        self._deliveries.append((ended, copy))

    def _retire_cancelled(self) -> None:
        cancelled = [s for s in self._in_flight() if s.cancelled]
        if not cancelled:
            return
        self.rows.deactivate([s.slot for s in cancelled])
        for resident in cancelled:
            resident.retired = True
            self.occupants[resident.slot] = None
            self._residents.remove(resident)
        self.cancelled += len(cancelled)

    def _compact(self) -> None:
        """Move the sentences in the highest slots into free lower ones, so that a step's
        bucket holds them all: one move for all."""
        in_flight = self._in_flight()
        if not in_flight:
            return
        size = bucket(len(in_flight))
        movers = [s for s in in_flight if s.slot >= size]
        if not movers:
            return
        holes = [i for i in range(size) if self.occupants[i] is None][: len(movers)]
        columns = bucket(1 + max(min(s.step, s.max_len) for s in movers), LEAST_COLUMNS)
        columns = min(columns, self.rows.capacity.columns)
        self.rows.move([s.slot for s in movers], holes, columns)
        for resident, hole in zip(movers, holes, strict=True):
            self.occupants[resident.slot] = None
            self.occupants[hole] = resident
            resident.slot = hole

    def _deliver(self) -> list[Finished]:
        """The results of the sentences retired at earlier calls: their copies were enqueued
        before the step just enqueued, so waiting for them does not wait for it."""
        finished = []
        while self._deliveries:
            ended, copy = self._deliveries.popleft()
            rows = EndedRows(*copy.ready())
            for index, resident in enumerate(ended):
                self._residents.remove(resident)
                if not resident.cancelled:
                    finished.append(Finished(resident.key, self._hypotheses(rows, index)))
        return finished

    def _hypotheses(self, rows: EndedRows, index: int) -> list[Hypothesis]:
        """Sentence ``index`` of ``rows``: its hypotheses, best first, as fairseq's dicts."""
        beam = self.beam
        count = int(rows.counts[index])
        first = index * beam
        nbest: NBest[int] = NBest(beam, evict_worst=False)
        for row in range(first, first + count):
            nbest.add(float(rows.scores[row]), row)
        hypotheses = []
        with torch.inference_mode(False):  # callers change them in place (fairseq-generate)
            for row in nbest.best_first(self.options.nbest):
                length = int(rows.lengths[row])
                cumulative = rows.cumulative[row, : length + 1]
                hypotheses.append({
                    "tokens": rows.tokens[row, 1 : length + 1].clone(),
                    "score": rows.scores[row].clone(),
                    "attention": torch.empty(0),
                    "alignment": torch.empty(0),
                    "positional_scores": cumulative[1:] - cumulative[:-1],
                })  # fmt: skip
        return hypotheses


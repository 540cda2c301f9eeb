"""Admission: which waiting requests join the sentences in flight, and when.

Requests wait in arrival order until the engine has room for all sentences of one. For models
that mix steps (continuous batching) the scheduler takes a window of requests ahead of room for
them, groups the window by source width for the encoder and queues it narrowest first after the
windows before it: sentences in flight are then of similar width (the attention reads fewer
padded positions), and a request waits at most for the windows planned before its own. Each
group is encoded when its first request joins. Other models are admitted batch after batch,
when the engine is empty, as fairseq decodes.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.engine.requests import Request
from beamplugin.modules.width_groups import cheapest_runs
from beamplugin.runtime.host_transfer import to_host
from beamplugin.search.constraints import check_constraints
from beamplugin.search.options import DecodingOptions

# An encoder forward costs as much as this many padded tokens more (measured: docs/speed.md): it
# reads all its weights once per forward, so widths are grouped only where padding costs less
# than another forward.
ENCODER_FORWARD_TOKENS = 26
# Requests taken ahead of room for them: at least ENCODE_AHEAD, or ENCODE_AHEAD_PER_SLOT times
# the capacity in sentences: random arrivals sort into fewer, denser width groups among more.
ENCODE_AHEAD = 512
ENCODE_AHEAD_PER_SLOT = 8
# While sentences decode and more may come (a server), fewer than ENCODE_GROUP waiting
# sentences wait up to MAX_ADMISSION_DELAY steps for company: a sentence encoded alone costs
# much more than one of a group (docs/speed.md).
ENCODE_GROUP = 8
MAX_ADMISSION_DELAY = 2


class Encoded(NamedTuple):
    outs: list[Any]  # per model, the encoder output of the request's group
    rows: slice  # the request's rows in it


@dataclass(eq=False)
class Waiting:
    """A request waiting for room, and once encoded, where its encoder output is."""

    request: Request
    since: int  # the engine's step count when it came
    group: list[Waiting] | None = None  # the requests it is to be encoded with, once planned
    encoded: Encoded | None = None

    def release(self) -> None:
        """Once admitted, let go of its encoder output (the memory pools hold what the decoder
        reads) and of its group: the group's list and its members form a reference cycle, which
        held every group's encoder output until the garbage collector ran (100 MB at big size,
        64 sentences)."""
        self.encoded = self.group = None


class Admission(NamedTuple):
    """What the scheduler admits at once: requests in their order, and the groups of requests
    (some of them, or others of their windows) that must be encoded first."""

    admitted: list[Waiting]
    to_encode: list[list[Waiting]]


class Scheduler:
    """The waiting requests of an engine of ``max_sentences`` sentences and ``max_tokens``
    tokens (each sentence counts beam x its source width); ``None``: unbounded."""

    def __init__(
        self,
        model: EnsembleDecoder,
        options: DecodingOptions,
        max_sentences: int | None,
        max_tokens: int | None,
    ) -> None:
        self.options = options
        self.beam = options.beam_size
        self.mixes_steps = model.mixes_steps
        self.max_source_positions = model.max_source_positions()
        self.model = model  # its target vocabulary bounds the constraints' tokens
        self.max_sentences, self.max_tokens = max_sentences, max_tokens
        self.waiting: deque[Waiting] = deque()  # checked requests not in flight yet
        self.encode_ahead = (
            max(ENCODE_AHEAD_PER_SLOT * (max_sentences or 0), ENCODE_AHEAD)
            if max_sentences or max_tokens else math.inf
        )

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` can never be decoded here; else set its max_len."""
        limit = self.max_source_positions
        if request.width > limit:
            raise ValueError(
                f"a source of {request.width} tokens is longer than the model accepts "
                f"({limit} tokens, end of sentence included)"
            )
        if self.max_sentences and len(request.keys) > self.max_sentences:
            raise ValueError(
                f"{len(request.keys)} sentences at once, more than the capacity of "
                f"{self.max_sentences} sentences"
            )
        cost = self.beam * request.width * len(request.keys)
        if self.max_tokens and cost > self.max_tokens:
            raise ValueError(
                f"a source of {request.width} tokens needs {cost} tokens with beam {self.beam}, "
                f"more than the capacity of {self.max_tokens} tokens"
            )
        request.max_len = self._output_limit(request)
        if request.constraints is not None:
            self._check_constraints(request)

    def _check_constraints(self, request: Request) -> None:
        """Raise ValueError if the request's constraints cannot be decoded (see
        beamplugin.search.constraints.check_constraints): its sentences fail, no other."""
        options = self.options
        if len(request.constraints) != len(request.keys):
            raise ValueError(
                f"{len(request.constraints)} constraint lists for {len(request.keys)} sentences"
            )
        if options.constraints is None and any(request.constraints):
            raise ValueError(
                "this search was not built for lexical constraints (options.constraints: "
                "'ordered' or 'unordered')"
            )
        vocab = len(self.model.models[0].decoder.dictionary)
        special = {"EOS": options.eos, "padding": options.pad, "BOS": 0}
        for constraints in filter(None, request.constraints):
            check_constraints(constraints, request.max_len, vocab, special)

    def _output_limit(self, request: Request) -> int:
        options = self.options
        if options.match_source_len:
            max_len = int(to_host(request.source_lengths(options).max())[0])
        else:
            max_len = min(
                int(options.max_len_a * request.width + options.max_len_b), options.max_len - 1
            )
        if options.min_len > max_len:
            raise ValueError(
                f"min_len={options.min_len} is larger than the maximum output length {max_len} "
                f"for this input (max_len_a={options.max_len_a}, max_len_b={options.max_len_b})"
            )
        return max_len

    def enqueue(self, request: Request, step: int) -> None:
        """Let ``request`` (checked) wait for room; ``step``: the engine's step count."""
        self.waiting.append(Waiting(request, step))

    def cancel(self, keys: set) -> int:
        """Drop the waiting requests whose sentences are all in ``keys``; how many sentences
        that drops."""
        dropped = [w for w in self.waiting if all(key in keys for key in w.request.keys)]
        if dropped:
            self.waiting = deque(w for w in self.waiting if w not in dropped)
        return sum(len(w.request.keys) for w in dropped)

    def wants_requests(self, in_flight: int) -> bool:
        """Whether to take another request: until ``encode_ahead`` wait, for models that mix
        steps; otherwise while all that wait fit into the next batch."""
        if self.mixes_steps:
            return len(self.waiting) < self.encode_ahead
        return not in_flight and self._fitting(0, 0) == len(self.waiting)

    def schedule(
        self, in_flight: int, tokens_in_flight: int, step: int, more_coming: bool
    ) -> Admission | None:
        """The waiting requests that fit beside ``in_flight`` sentences of ``tokens_in_flight``
        tokens, taken off the queue, or None. ``more_coming``: more requests may arrive soon,
        so while others decode, a few may wait a little to be planned and encoded together."""
        count = self._fitting(in_flight, tokens_in_flight)
        if not count:
            return None
        if self.mixes_steps and self.waiting[count - 1].group is None:
            if more_coming and in_flight and self._gathering(step):
                return None
            self._plan()
            count = self._fitting(in_flight, tokens_in_flight)
            if not count:
                return None
        admitted = [self.waiting.popleft() for _ in range(count)]
        if not any(item.encoded is None for item in admitted):
            return Admission(admitted, [])
        if not self.mixes_steps:
            return Admission(admitted, [admitted])
        unencoded = (item.group for item in admitted if item.encoded is None)
        return Admission(admitted, list({id(group): group for group in unencoded}.values()))

    def _fitting(self, in_flight: int, tokens_in_flight: int) -> int:
        """How many waiting requests, from the first, there is room for now."""
        if in_flight and not self.mixes_steps:
            return 0
        requests: Iterable[Request] = (w.request for w in self.waiting)
        fitting, count, cost = 0, in_flight, tokens_in_flight
        for request in requests:
            count += len(request.keys)
            cost += self.beam * request.width * len(request.keys)
            if (self.max_sentences and count > self.max_sentences) or (
                self.max_tokens and cost > self.max_tokens
            ):
                break
            fitting += 1
        return fitting

    def _gathering(self, step: int) -> bool:
        """Whether the waiting requests, not planned yet, should wait for more (never once
        the engine takes no more ahead)."""
        sentences = sum(len(w.request.keys) for w in self.waiting)
        return (
            sentences < ENCODE_GROUP
            and len(self.waiting) < self.encode_ahead
            and step - self.waiting[0].since < MAX_ADMISSION_DELAY
        )

    def _plan(self) -> None:
        """Group the waiting requests not planned yet for the encoder, and queue them in the
        groups' order, narrowest first, after those planned before."""
        planned = [w for w in self.waiting if w.group is not None]
        groups = similar_widths([w for w in self.waiting if w.group is None])
        for group in groups:
            for item in group:
                item.group = group
        self.waiting = deque(planned + list(itertools.chain.from_iterable(groups)))


def similar_widths(waiting: list[Waiting]) -> list[list[Waiting]]:
    """``waiting`` in the groups that cost the encoder least, narrowest first: a group costs
    ENCODER_FORWARD_TOKENS plus its rows times its widest source (cheapest_runs of the
    requests' widths); within a group, by width, requests of one width in the order of
    ``waiting``."""
    rows_at: dict[int, int] = {}
    for item in waiting:
        rows_at[item.request.width] = rows_at.get(item.request.width, 0) + len(item.request.keys)
    runs = cheapest_runs(rows_at, ENCODER_FORWARD_TOKENS)
    group_of = {width: n for n, run in enumerate(runs) for width in run}
    groups: list[list[Waiting]] = [[] for _ in runs]
    for item in sorted(waiting, key=lambda w: w.request.width):
        groups[group_of[item.request.width]].append(item)
    return groups

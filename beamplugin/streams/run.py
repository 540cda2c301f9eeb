"""Driving an engine from a source of requests: every way in (``SequenceGenerator.generate``,
the task's continuous ``fairseq-generate``, :func:`~beamplugin.streams.translate.translate`,
:class:`~beamplugin.streams.translation_stream.TranslationStream`) is built on :func:`run`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from beamplugin.engine.device_engine import DeviceEngine
from beamplugin.engine.engine import DecodingEngine
from beamplugin.engine.requests import Finished, Request
from beamplugin.search.constraints import Constraints


class Prompt(NamedTuple):
    """What a sentence's hypotheses start with: ``bos`` (None: the engine's), then the forced
    ``prefix`` (1-D, pad: free choice; None: none). A multilingual model's target-language token
    is one or the other."""

    prefix: Tensor | None = None
    bos: int | None = None


class Source(Protocol):
    """Where :func:`run` takes requests from."""

    def take(self, wait: bool) -> Request | None:
        """The next request; None if none is there now (or, once ``exhausted``, ever).
        ``wait``: the engine is idle, so block until one comes or the source ends."""

    def cancellations(self) -> list[Any]:
        """Keys of the sentences cancelled since the last call; :func:`run` hands them to the
        engine between steps (keys it does not hold are ignored)."""

    @property
    def exhausted(self) -> bool: ...


class Observer(Protocol):
    """What :func:`run` reports besides results (a server's metrics)."""

    def admitted(self, keys: list[Any]) -> None:
        """Sentences just put in flight."""

    def stepped(self, sentences: int, seconds: float) -> None:
        """A step of ``sentences`` sentences took ``seconds``."""


class IteratorSource:
    """Requests from an iterator, taken as the engine has room for them."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self._requests = iter(requests)
        self.exhausted = False

    def take(self, wait: bool) -> Request | None:
        request = next(self._requests, None)
        self.exhausted = request is None
        return request

    def cancellations(self) -> list[Any]:
        return []


def run(
    engine: DecodingEngine | DeviceEngine, source: Source, observer: Observer | None = None
) -> Iterator[Finished]:
    """Decode every request of ``source``; yields each sentence as soon as it is finished.

    Requests are taken as the engine wants them and admitted whenever it has room for them
    (all sentences of one request together). A request that can never be decoded (too long for
    the model or for the capacity) comes back as Finished results with the error, and the
    others go on. Sentences the source cancels leave the engine between steps (see
    DecodingEngine.cancel).
    """
    while True:
        cancelled = source.cancellations()
        if cancelled:
            engine.cancel(cancelled)
        while not source.exhausted and engine.wants_requests():
            request = source.take(wait=engine.idle)
            if request is None:
                break
            try:
                engine.check(request)
            except ValueError as error:
                yield from (Finished(key, [], error) for key in request.keys)
                continue
            engine.enqueue(request)
        in_flight = len(engine.live)
        engine.admit_waiting(more_coming=not source.exhausted)
        if not engine.live:
            if source.exhausted and not engine.waiting:
                return
            continue
        if observer is None:
            yield from engine.step()
            continue
        if len(engine.live) > in_flight:  # admitted now: no step taken yet
            observer.admitted([s.key for s in engine.live if s.step == 0])
        sentences, started = len(engine.live), time.perf_counter()
        finished = engine.step()
        observer.stepped(sentences, time.perf_counter() - started)
        yield from finished


def sentence_request(
    key: Any,
    src_tokens: Tensor,
    prefix_tokens: Tensor | None,
    bos: int | None = None,
    constraints: Constraints | None = None,
) -> Request:
    """A request of one sentence: ``src_tokens`` 1-D, no padding (ending in EOS, or in the
    language token that replaces it); decoded as fairseq-generate and fairseq-interactive decode
    it in a batch of its own, its hypotheses forced to start with ``prefix_tokens`` (1-D, pad:
    free choice) after ``bos`` (None: the engine's), and to contain ``constraints`` (token
    sequences, met as the engine's options say; None: none)."""
    if src_tokens.dim() != 1 or src_tokens.numel() == 0:
        raise ValueError(
            f"a sentence is a non-empty 1-D token tensor, got shape {tuple(src_tokens.shape)}"
        )
    prefix = None if prefix_tokens is None else prefix_tokens.view(1, -1)
    # its length as fairseq's collater gives it (EOS included) for match_source_len
    length = torch.full((1,), len(src_tokens), device=src_tokens.device)
    return Request(
        [key], src_tokens.unsqueeze(0), length, prefix, bos=bos,
        constraints=None if constraints is None else [constraints],
    )  # fmt: skip

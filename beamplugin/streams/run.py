"""Driving an engine from a source of requests: every way in (``SequenceGenerator.generate``,
the task's continuous ``fairseq-generate``, :func:`~beamplugin.streams.translate.translate`,
:class:`~beamplugin.streams.translation_stream.TranslationStream`) is built on :func:`run`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from beamplugin.engine.engine import DecodingEngine
from beamplugin.engine.requests import Finished, Request


class Source(Protocol):
    """Where :func:`run` takes requests from."""

    def take(self, wait: bool) -> Request | None:
        """The next request; None if none is there now (or, once ``exhausted``, ever).
        ``wait``: the engine is idle, so block until one comes or the source ends."""

    @property
    def exhausted(self) -> bool: ...


class IteratorSource:
    """Requests from an iterator, taken as the engine has room for them."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self._requests = iter(requests)
        self.exhausted = False

    def take(self, wait: bool) -> Request | None:
        request = next(self._requests, None)
        self.exhausted = request is None
        return request


def run(engine: DecodingEngine, source: Source) -> Iterator[Finished]:
    """Decode every request of ``source``; yields each sentence as soon as it is finished.

    Requests are taken as the engine wants them and admitted whenever it has room for them
    (all sentences of one request together). A request that can never be decoded (too long for
    the model or for the capacity) comes back as Finished results with the error, and the
    others go on.
    """
    while True:
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
        engine.admit_waiting(more_coming=not source.exhausted)
        if not engine.live:
            if source.exhausted and not engine.waiting:
                return
            continue
        yield from engine.step()


def sentence_request(key: Any, src_tokens: Tensor, prefix_tokens: Tensor | None) -> Request:
    """A request of one sentence: ``src_tokens`` 1-D, ending in EOS, no padding; decoded as
    fairseq-generate and fairseq-interactive decode it in a batch of its own."""
    if src_tokens.dim() != 1 or src_tokens.numel() == 0:
        raise ValueError(
            f"a sentence is a non-empty 1-D token tensor, got shape {tuple(src_tokens.shape)}"
        )
    prefix = None if prefix_tokens is None else prefix_tokens.view(1, -1)
    # its length as fairseq's collater gives it (EOS included) for match_source_len
    length = torch.full((1,), len(src_tokens), device=src_tokens.device)
    return Request([key], src_tokens.unsqueeze(0), length, prefix)

"""Decoding a stream of sentences on one engine: whenever sentences finish, the next ones are
admitted into the freed capacity, mid-search (continuous batching).

* :func:`run` drives an engine from a :class:`Source`; every other way in is built on it:
  ``SequenceGenerator.generate`` (a whole batch as one request), the task's continuous
  ``fairseq-generate`` and the functions below;
* :func:`translate` decodes an iterable of sentences in the caller's thread and yields each
  result as soon as it is finished (completion order) or in input order;
* :class:`TranslationStream` takes sentences from any thread (``submit`` returns a future) and
  decodes them in a thread of its own, with a bounded queue in front.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from beamplugin.engine import DecodingEngine, Finished, Request
from beamplugin.search.nbest import Hypothesis

if TYPE_CHECKING:
    from beamplugin.sequence_generator import SequenceGenerator


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


def translate(
    generator: SequenceGenerator,
    sentences: Iterable[Tensor],
    max_sentences: int | None = 64,
    max_tokens: int | None = None,
    ordered: bool = False,
) -> Iterator[tuple[int, list[Hypothesis] | Exception]]:
    """Decode ``sentences`` (1-D token tensors ending in EOS) as one stream, with at most
    ``max_sentences`` sentences / ``max_tokens`` tokens (beam x source length) in flight.

    Yields ``(index, hypotheses best first)``, or ``(index, error)`` for a sentence that cannot
    be decoded, as soon as each is finished; ``ordered``: in input order instead.
    """
    engine = DecodingEngine(generator, max_sentences, max_tokens)
    requests = (sentence_request(i, tokens, None) for i, tokens in enumerate(sentences))
    with torch.inference_mode():
        results = ((f.key, f.error or f.hypotheses) for f in run(engine, IteratorSource(requests)))
        if not ordered:
            yield from results
            return
        waiting: dict[int, Any] = {}
        next_index = 0
        for index, result in results:
            waiting[index] = result
            while next_index in waiting:
                yield next_index, waiting.pop(next_index)
                next_index += 1


class QueueFull(RuntimeError):
    """The stream's queue is full; try again later."""


class StreamClosed(RuntimeError):
    """The stream takes no more sentences."""


class StreamFailed(StreamClosed):
    """The stream's decoder failed (its error is the cause); it takes no more sentences."""


_CLOSE = object()


class TranslationStream:
    """Sentences submitted from any thread, decoded together on one engine in a thread of its
    own; each ``submit`` returns a future of the sentence's hypotheses (best first).

    At most ``max_queued`` sentences wait in the queue (besides those the engine has taken ahead
    to encode, 512 or eight times its capacity): then ``submit`` blocks, or with ``block=False``
    (or after ``timeout``) raises :class:`QueueFull`. ``close()`` takes no more sentences and
    returns once every accepted one is decoded.
    """

    def __init__(
        self,
        generator: SequenceGenerator,
        max_sentences: int | None = 64,
        max_tokens: int | None = None,
        max_queued: int = 256,
    ) -> None:
        self.engine = DecodingEngine(generator, max_sentences, max_tokens)
        self._queue: queue.Queue[Any] = queue.Queue(max_queued)
        self._closed = threading.Event()
        self._lock = threading.Lock()  # orders close() after every submit() that got in
        self.exhausted = False
        self.completed = 0
        self.failure: BaseException | None = None  # why the decoder stopped, if it failed
        self._thread = threading.Thread(target=self._decode, name="beamplugin-decoder", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Sentences accepted and not in flight yet (the decoder takes some ahead)."""
        return self._queue.qsize() + len(self.engine.waiting)

    @property
    def in_flight(self) -> int:
        return len(self.engine.live)

    def submit(
        self,
        src_tokens: Tensor,
        prefix_tokens: Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> Future:
        future: Future = Future()
        request = sentence_request(future, src_tokens, prefix_tokens)
        with self._lock:
            self._check_open()
            try:
                self._queue.put(request, block, timeout)
            except queue.Full:
                raise QueueFull(f"{self._queue.maxsize} sentences are waiting already") from None
        return future

    def submit_together(self, sentences: list[Tensor]) -> list[Future]:
        """Futures of several sentences (each decoded as on its own), queued all at once or, when
        fewer places are free in the queue, none (:class:`QueueFull`): a caller that is refused
        has nothing half-accepted."""
        requests = [sentence_request(Future(), tokens, None) for tokens in sentences]
        with self._lock:  # no other submit can take the places counted free here
            self._check_open()
            if len(requests) > self._queue.maxsize:
                raise ValueError(
                    f"{len(requests)} sentences at once, more than the queue holds "
                    f"({self._queue.maxsize})"
                )
            if self._queue.maxsize - self._queue.qsize() < len(requests):  # only grows meanwhile
                raise QueueFull(f"no room for {len(requests)} more sentences in the queue")
            for request in requests:
                self._queue.put_nowait(request)
        return [request.keys[0] for request in requests]

    def _check_open(self) -> None:
        if self.failure is not None:
            raise StreamFailed(f"the decoder failed: {self.failure!r}") from self.failure
        if self._closed.is_set():
            raise StreamClosed("the stream is closed")

    def take(self, wait: bool) -> Request | None:
        try:
            item = self._queue.get(block=wait)
        except queue.Empty:
            return None
        if item is _CLOSE:
            self.exhausted = True
            return None
        return item

    def _decode(self) -> None:
        try:
            with torch.inference_mode():
                for finished in run(self.engine, self):
                    future: Future = finished.key
                    self.completed += 1
                    if finished.error is not None:
                        future.set_exception(finished.error)
                    else:
                        future.set_result(finished.hypotheses)
        except BaseException as error:  # a failing model: nobody may wait forever
            self.failure = error
            engine = self.engine
            waiting = [s.key for s in engine.live]
            waiting += [key for w in engine.waiting for key in w.request.keys]
            self._fail(waiting)  # also frees a submit blocked on the full queue
            with self._lock:  # later submits are refused
                self._closed.set()
            self._fail([])  # what got in meanwhile
            raise

    def _fail(self, futures: list[Future]) -> None:
        """Give ``futures`` and every sentence in the queue the decoder's failure."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not _CLOSE:
                futures.extend(item.keys)
        for future in futures:
            if not future.done():
                future.set_exception(self.failure)

    def close(self, timeout: float | None = None) -> None:
        """Take no more sentences; return when those accepted are decoded."""
        with self._lock:
            if not self._closed.is_set():
                self._closed.set()
                while self._thread.is_alive():  # a full queue drains while the decoder lives
                    try:
                        self._queue.put(_CLOSE, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        self._thread.join(timeout)

    def __enter__(self) -> TranslationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Sentences submitted from any thread (``submit`` returns a future), decoded together on one
engine in a thread of its own, with a bounded queue in front."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from beamplugin.engine.engine import Decoder, DecodingEngine
from beamplugin.engine.requests import Request
from beamplugin.streams.run import run, sentence_request


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
        generator: Decoder,
        max_sentences: int | None = 64,
        max_tokens: int | None = None,
        max_queued: int = 256,
    ) -> None:
        self.engine = DecodingEngine.of(generator, max_sentences, max_tokens)
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

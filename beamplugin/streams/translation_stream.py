"""Sentences submitted from any thread (``submit`` returns a future), decoded together on one
engine in a thread of its own, with a bounded queue in front. Cancelling a future
(``Future.cancel``, from any thread) cancels its sentence: dropped from the queue, or out of the
engine with its next step."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

import torch
from torch import Tensor

from beamplugin.engine.choice import engine_for
from beamplugin.engine.engine import Decoder
from beamplugin.engine.requests import Request
from beamplugin.search.constraints import Constraints
from beamplugin.streams.run import Prompt, run, sentence_request


class QueueFull(RuntimeError):
    """The stream's queue is full; try again later."""


class StreamClosed(RuntimeError):
    """The stream takes no more sentences."""


class StreamFailed(StreamClosed):
    """The stream's decoder failed (its error is the cause); it takes no more sentences."""


class StreamObserver(Protocol):
    """What a stream reports as it decodes (a server's metrics); called in its decoder thread."""

    def stepped(self, sentences: int, seconds: float) -> None:
        """A step of ``sentences`` sentences took ``seconds``."""

    def waited(self, seconds: list[float]) -> None:
        """Sentences just put in flight waited ``seconds`` since they were submitted."""


_CLOSE = object()


class TranslationStream:
    """Sentences submitted from any thread, decoded together on one engine in a thread of its
    own; each ``submit`` returns a future of the sentence's hypotheses (best first).

    At most ``max_queued`` sentences wait in the queue (besides those the engine has taken ahead
    to encode, 512 or eight times its capacity): then ``submit`` blocks, or with ``block=False``
    (or after ``timeout``) raises :class:`QueueFull`. ``close()`` takes no more sentences and
    returns once every accepted one is decoded. ``observer``, set at any time, hears of every
    step and admission from then on.
    """

    def __init__(
        self,
        generator: Decoder,
        max_sentences: int | None = 64,
        max_tokens: int | None = None,
        max_queued: int = 256,
    ) -> None:
        self.engine = engine_for(generator, max_sentences, max_tokens)
        self._queue: queue.Queue[Any] = queue.Queue(max_queued)
        self._closed = threading.Event()
        self._lock = threading.Lock()  # orders close() after every submit() that got in
        self.exhausted = False
        self.completed = 0
        self.cancelled = 0  # futures cancelled before they were resolved
        self.failure: BaseException | None = None  # why the decoder stopped, if it failed
        self.observer: StreamObserver | None = None
        self._cancelled: list[Future] = []  # not handed to the engine yet
        self._cancel_lock = threading.Lock()
        self._submitted: dict[Future, float] = {}  # when, while observed and not in flight
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
        bos: int | None = None,
        constraints: Constraints | None = None,
    ) -> Future:
        """A future of the hypotheses of ``src_tokens`` (1-D), forced to start with
        ``prefix_tokens`` after ``bos`` and to contain ``constraints`` (see
        :func:`~beamplugin.streams.run.sentence_request`)."""
        future = self._future()
        request = sentence_request(future, src_tokens, prefix_tokens, bos, constraints)
        with self._lock:
            self._check_open()
            try:
                self._queue.put(request, block, timeout)
            except queue.Full:
                self._submitted.pop(future, None)
                raise QueueFull(f"{self._queue.maxsize} sentences are waiting already") from None
        return future

    def submit_together(
        self,
        sentences: list[Tensor],
        prompt: Prompt | None = None,
        constraints: list[Constraints | None] | None = None,
    ) -> list[Future]:
        """Futures of several sentences (each decoded as on its own, its hypotheses starting with
        ``prompt``, if any, and containing its ``constraints``, if any), queued all at once or,
        when fewer places are free in the queue, none (:class:`QueueFull`): a caller that is
        refused has nothing half-accepted."""
        with self._lock:  # no other submit can take the places counted free here
            self._check_open()
            if len(sentences) > self._queue.maxsize:
                raise ValueError(
                    f"{len(sentences)} sentences at once, more than the queue holds "
                    f"({self._queue.maxsize})"
                )
            if self._queue.maxsize - self._queue.qsize() < len(sentences):  # only grows meanwhile
                raise QueueFull(f"no room for {len(sentences)} more sentences in the queue")
            prefix, bos = prompt or Prompt()
            own = constraints or [None] * len(sentences)
            requests = [
                sentence_request(self._future(), tokens, prefix, bos, sentence_constraints)
                for tokens, sentence_constraints in zip(sentences, own, strict=True)
            ]
            for request in requests:
                self._queue.put_nowait(request)
        return [request.keys[0] for request in requests]

    def _future(self) -> Future:
        """A sentence's future, which tells the stream when it is cancelled."""
        future: Future = Future()
        future.add_done_callback(self._resolved)
        if self.observer is not None:
            self._submitted[future] = time.perf_counter()
        return future

    def _resolved(self, future: Future) -> None:
        """In whichever thread resolves or cancels ``future``: note a cancellation, for the
        decoder thread to hand to the engine between steps."""
        if future.cancelled():
            self._submitted.pop(future, None)
            with self._cancel_lock:
                self._cancelled.append(future)
                self.cancelled += 1

    def cancellations(self) -> list[Any]:
        if not self._cancelled:  # the common case, without the lock
            return []
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def admitted(self, keys: list[Any]) -> None:
        if not self._submitted:
            return
        now = time.perf_counter()
        waits = []
        for key in keys:
            submitted = self._submitted.pop(key, None)
            if submitted is not None:
                waits.append(now - submitted)
        if self.observer is not None and waits:
            self.observer.waited(waits)

    def stepped(self, sentences: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer.stepped(sentences, seconds)

    def _check_open(self) -> None:
        if self.failure is not None:
            raise StreamFailed(f"the decoder failed: {self.failure!r}") from self.failure
        if self._closed.is_set():
            raise StreamClosed("the stream is closed")

    def take(self, wait: bool) -> Request | None:
        while True:
            try:
                item = self._queue.get(block=wait)
            except queue.Empty:
                return None
            if item is _CLOSE:
                self.exhausted = True
                return None
            if not item.keys[0].cancelled():  # a cancelled one is dropped here
                return item

    def _decode(self) -> None:
        try:
            with torch.inference_mode():
                for finished in run(self.engine, self, self):
                    future: Future = finished.key
                    self.completed += 1
                    try:
                        if finished.error is not None:
                            self._submitted.pop(future, None)  # never admitted
                            future.set_exception(finished.error)
                        else:
                            future.set_result(finished.hypotheses)
                    except InvalidStateError:  # cancelled just now: nobody wants it
                        pass
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
            try:
                future.set_exception(self.failure)
            except InvalidStateError:  # cancelled meanwhile
                pass

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

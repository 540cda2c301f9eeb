"""Decoding in a process of its own, so that the server's event loop and the decoder do not
share one interpreter lock: the loop parses, encodes and answers on one core while the engine
decodes on another.

The child process loads the models and runs a :class:`~beamplugin.streams.TranslationStream`;
:func:`relay` connects it to a pipe. The parent holds a :class:`DecoderProcess`, which has the
stream's interface as the server uses it (``submit_together`` returning futures, ``queued``,
``in_flight``, ``completed``, ``failure``, ``close``) and counts what it has sent, so a full
queue is refused in the parent without a round trip.

Cancelling a future in the parent sends :class:`~beamplugin.serving.messages.Cancel` down the
pipe; the child cancels its own future of the sentence, which drops it from its stream (see
TranslationStream), and answers :class:`~beamplugin.serving.messages.Cancelled`. The child also
reports its steps (sentences, seconds) and queue waits to the parent's ``observer``. Every
message is a named type of beamplugin.serving.messages.

The child ignores SIGTERM and SIGINT (process managers signal the whole group): the parent
decides when to stop, with ``close``, and the child then finishes every accepted sentence. A
child that dies (killed, out of memory) fails the sentences it had, and another is started, after
a backoff that grows while they keep dying; meanwhile submits raise :class:`DecoderRestarting`.
The first one failing to start raises its error in the parent.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from beamplugin.search.constraints import Constraints
from beamplugin.search.nbest import Hypothesis
from beamplugin.serving.loading import DecoderSettings, decoding_device, load_decoder
from beamplugin.serving.messages import (
    Answer,
    Cancel,
    Cancelled,
    Close,
    Closed,
    Done,
    Error,
    FromChild,
    Ready,
    Sentence,
    StartFailed,
    Stats,
    Submit,
    ToChild,
)
from beamplugin.streams import (
    Prompt,
    QueueFull,
    StreamClosed,
    StreamFailed,
    StreamObserver,
    TranslationStream,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig


logger = logging.getLogger(__name__)


class DecoderRestarting(RuntimeError):
    """The decoder process died and its successor is not ready yet; try again later."""


class Backoff:
    """Seconds to wait before starting another decoder process: 1 s after a death, doubling
    with each death in a row up to 30 s; a process that lived a minute starts the series
    again. So a model that keeps crashing is started a few times a minute at most."""

    FIRST, MOST, STEADY = 1.0, 30.0, 60.0

    def __init__(self) -> None:
        self._next = self.FIRST

    def wait(self, lived: float | None) -> float:
        """The wait before the next start, after a process that lived ``lived`` seconds died
        (None: after one failed to start)."""
        if lived is not None and lived >= self.STEADY:
            self._next = self.FIRST
        wait, self._next = self._next, min(2 * self._next, self.MOST)
        return wait


class _Child:
    """One decoder process and the parent's end of its pipe."""

    def __init__(self, cfg: DictConfig, max_queued: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_child_main, args=(cfg, max_queued, child_end), name="beamplugin-decoder"
        )
        self.process.start()
        child_end.close()  # so that the child's end closes when the child exits
        try:
            started: Ready | StartFailed = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the decoder process exited while starting (exit code {self.process.exitcode})"
            ) from None
        if isinstance(started, StartFailed):
            self.process.join()
            raise started.error
        self.settings: DecoderSettings = started.settings
        self.started = time.monotonic()


class DecoderProcess:
    """A TranslationStream decoding in a child process; at most ``max_queued`` sentences wait
    for room in its engine (beyond that ``submit_together`` raises QueueFull). Cancelling a
    future cancels its sentence in the child. A child that dies fails the sentences it held
    and is replaced (with backoff; meanwhile ``restarting``, and submits raise
    DecoderRestarting); one whose model fails fails everything from then on (``failure``)."""

    def __init__(self, cfg: DictConfig, max_queued: int) -> None:
        self._cfg = cfg
        self._child = _Child(cfg, max_queued)  # the first one's errors are the caller's
        self.settings: DecoderSettings = self._child.settings
        self.max_queued = max_queued
        self._futures: dict[int, Future] = {}  # sent, not answered yet
        self._next_key = 0
        self._lock = threading.Lock()  # submits against each other and against the reader
        self._closed = False
        self._stop = threading.Event()  # close() during a restart's backoff
        self.in_flight = 0  # as the child last reported it
        self.completed = 0
        self.cancelled = 0  # futures cancelled before they were resolved
        self.restarts = 0
        self.restarting = False
        self.failure: BaseException | None = None
        self.observer: StreamObserver | None = None
        self._reader = threading.Thread(target=self._supervise, name="beamplugin-results",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    @property
    def pid(self) -> int | None:
        """The decoder process's (the current one's)."""
        return self._child.process.pid

    @property
    def queued(self) -> int:
        """Sentences accepted and not in flight yet."""
        return max(0, len(self._futures) - self.in_flight)

    def submit_together(
        self,
        sentences: list[Tensor],
        prompt: Prompt | None = None,
        constraints: list[Constraints | None] | None = None,
    ) -> list[Future]:
        """Futures of the sentences' hypotheses (best first, starting with ``prompt``, each
        containing its ``constraints``), all queued or, with too few places free, none
        (QueueFull)."""
        with self._lock:
            self._check_open()
            if len(sentences) > self.max_queued:
                raise ValueError(
                    f"{len(sentences)} sentences at once, more than the queue holds "
                    f"({self.max_queued})"
                )
            # Room: the queue, and the engine's capacity (or what it holds now, when counted
            # in tokens). The child's queue is larger, so it never refuses what passed here.
            room = self.max_queued + (self.settings.max_sentences or self.in_flight)
            if len(self._futures) + len(sentences) > room:
                raise QueueFull(f"no room for {len(sentences)} more sentences in the queue")
            keys = range(self._next_key, self._next_key + len(sentences))
            self._next_key += len(sentences)
            try:
                own = constraints or [None] * len(sentences)
                self._child.conn.send(Submit([
                    Sentence(key, tokens.cpu().numpy(), sentence_constraints)
                    for key, tokens, sentence_constraints in zip(keys, sentences, own, strict=True)
                ], *_prompt_arrays(prompt)))  # fmt: skip
            except OSError:  # the child is gone; the reader fails the rest and restarts it
                raise DecoderRestarting("the decoder process is gone; restarting") from None
            futures = [Future() for _ in sentences]
            for key, future in zip(keys, futures, strict=True):
                future.add_done_callback(lambda f, key=key: self._resolved(key, f))
                self._futures[key] = future
        return futures

    def _check_open(self) -> None:
        if self.failure is not None:
            raise StreamFailed(f"the decoder failed: {self.failure!r}") from self.failure
        if self._closed:
            raise StreamClosed("the stream is closed")
        if self.restarting:
            raise DecoderRestarting("the decoder process is restarting")

    def _resolved(self, key: int, future: Future) -> None:
        """In whichever thread resolves or cancels ``future``: a cancellation goes to the
        child, which answers Cancelled (or the result, if it was quicker)."""
        if not future.cancelled():
            return
        with self._lock:
            self.cancelled += 1
            try:
                self._child.conn.send(Cancel([key]))
            except OSError:
                pass  # the child is gone, and the sentence with it

    def _supervise(self) -> None:
        """Read the child's answers; when it dies, fail what it held and start another."""
        backoff = Backoff()
        while True:
            child = self._child
            self._read(child)
            child.process.join()
            died = RuntimeError(f"the decoder process ended (exit code {child.process.exitcode})")
            with self._lock:
                futures, self._futures = list(self._futures.values()), {}
                self.in_flight = 0
                stopping = self._closed or self.failure is not None
                if self._closed and futures and self.failure is None:
                    self.failure = died  # it died while finishing: the server says so
                self.restarting = not stopping
            _fail(futures, died)
            if stopping:
                return
            wait = backoff.wait(lived=time.monotonic() - child.started)
            logger.error("%s; another starts in %.0f s", died, wait)
            while not self._stop.wait(wait):
                try:
                    replacement = _Child(self._cfg, self.max_queued)
                except Exception:
                    wait = backoff.wait(lived=None)
                    logger.exception("the decoder process did not start; again in %.0f s", wait)
                    continue
                with self._lock:
                    self._child, self.restarting = replacement, False
                    self.restarts += 1
                    if self._closed:  # closed while it started: it ends at once
                        replacement.conn.send(Close())
                logger.info("a new decoder process (pid %d) is ready", replacement.process.pid)
                break
            else:
                with self._lock:
                    self.restarting = False
                return

    def _read(self, child: _Child) -> None:
        """Resolve futures as ``child``'s answers come, until it ends."""
        while True:
            try:
                message: FromChild = child.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, Closed):
                return
            if isinstance(message, Stats):
                self.in_flight = message.in_flight
                if self.observer is not None:
                    for sentences, seconds in message.steps:
                        self.observer.stepped(sentences, seconds)
                    if message.waits:
                        self.observer.waited(message.waits)
                continue
            assert isinstance(message, Answer), message  # Ready came before the reader started
            with self._lock:
                future = self._futures.pop(message.key)
                self.in_flight = message.in_flight
                if not isinstance(message, Cancelled):
                    self.completed += 1
                if isinstance(message, Error) and message.failed and self.failure is None:
                    self.failure = message.error
            try:
                if isinstance(message, Done):
                    future.set_result([_tensors(h) for h in message.hypotheses])
                elif isinstance(message, Error):
                    future.set_exception(message.error)
            except InvalidStateError:  # cancelled here before the child heard of it
                pass

    def close(self, timeout: float | None = None) -> None:
        """Take no more sentences; return when those accepted are decoded and the child has
        exited."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._stop.set()
                try:
                    self._child.conn.send(Close())
                except OSError:
                    pass  # already gone: the reader has failed what it had
        self._reader.join(timeout)
        self._child.process.join(timeout)


def _fail(futures: list[Future], error: BaseException) -> None:
    for future in futures:
        try:
            future.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile
            pass


def log_to_stderr() -> None:
    """The server's log format, on stderr, in either of its processes."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=logging.INFO,
        stream=sys.stderr,
        force=True,  # fairseq's modules configure logging when imported
    )


def _child_main(cfg: DictConfig, max_queued: int, conn: Connection) -> None:
    """The decoder process: load the models, then decode what comes through ``conn``."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    log_to_stderr()
    from fairseq import utils

    try:
        utils.import_user_module(cfg.common)  # models and tasks of any other --user-dir
        generator, settings = load_decoder(cfg)
        # As large as the parent lets sentences be outstanding (the queue and at most the
        # engine's capacity: sentences, or fewer than its tokens), and a queue more for those
        # cancelled, which the parent stops counting while they still wait here to be dropped:
        # it never blocks the relay, which would stop reading while the parent waits to send.
        room = 2 * max_queued + (settings.max_sentences or settings.max_tokens)
        stream = settings.stream(generator, room)
    except BaseException as error:
        conn.send(StartFailed(_picklable(error)))
        return
    conn.send(Ready(settings))
    relay(stream, conn, decoding_device(cfg))


def relay(stream: TranslationStream, conn: Connection, device: torch.device) -> None:
    """Decode on ``stream`` (on ``device``) the sentences that come through ``conn``; send
    back each result as it is ready, Cancelled for each one cancelled, and the steps' figures
    now and then; on Close (or the parent's end closing), finish what was accepted, answer it,
    then say so (Closed)."""
    send_lock = threading.Lock()  # answers are sent from the stream's decoder thread
    pending: dict[int, Future] = {}  # by the parent's key, until answered

    def send(message: FromChild) -> None:
        with send_lock:
            try:
                conn.send(message)
            except OSError:
                pass  # the parent is gone: nobody to answer

    def answer(key: int, future: Future) -> None:
        pending.pop(key, None)
        failed = stream.failure is not None
        if future.cancelled():
            send(Cancelled(key, stream.in_flight))
        elif future.exception() is None:
            send(Done(key, [_arrays(h) for h in future.result()], stream.in_flight))
        else:
            send(Error(key, _picklable(future.exception()), stream.in_flight, failed))

    stream.observer = _StatsRelay(stream, send)
    while True:
        try:
            message: ToChild = conn.recv()
        except EOFError:
            break
        if isinstance(message, Close):
            break
        if isinstance(message, Cancel):
            for key in message.keys:
                future = pending.get(key)
                if future is not None:
                    future.cancel()  # answer() tells the parent
            continue
        prefix, bos = _prompt_on(device, message.prefix, message.bos)
        for key, tokens, constraints in message.sentences:
            try:
                future = stream.submit(
                    torch.from_numpy(tokens).to(device), prefix, bos=bos, constraints=constraints
                )
            except StreamClosed as refused:  # the decoder failed earlier
                send(Error(key, _picklable(refused), stream.in_flight, True))
                continue
            pending[key] = future  # before the callback, which may run at once
            future.add_done_callback(lambda f, key=key: answer(key, f))
    stream.close()
    send(Closed())


# Seconds between the child's reports of its steps (each also sent when the engine empties).
STATS_INTERVAL = 0.1


class _StatsRelay:
    """The child stream's observer: its steps and queue waits, sent to the parent in batches,
    with the sentences in flight after them."""

    def __init__(self, stream: TranslationStream, send: Callable[[Stats], None]) -> None:
        self._stream, self._send = stream, send
        self._steps: list[tuple[int, float]] = []
        self._waits: list[float] = []
        self._sent = 0.0

    def stepped(self, sentences: int, seconds: float) -> None:
        self._steps.append((sentences, seconds))
        now = time.monotonic()
        in_flight = self._stream.in_flight
        if now - self._sent >= STATS_INTERVAL or not in_flight:
            self._send(Stats(self._steps, self._waits, in_flight))
            self._steps, self._waits, self._sent = [], [], now

    def waited(self, seconds: list[float]) -> None:
        self._waits.extend(seconds)


def _arrays(hypothesis: Hypothesis) -> dict[str, Any]:
    """A hypothesis with numpy arrays for tensors: pickled as bytes, where torch would pass
    tensors through shared memory files."""
    return {
        name: value.cpu().numpy() if isinstance(value, Tensor) else value
        for name, value in hypothesis.items()
    }


def _tensors(hypothesis: dict[str, Any]) -> Hypothesis:
    return {
        name: torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        for name, value in hypothesis.items()
    }


def _prompt_arrays(prompt: Prompt | None) -> tuple[np.ndarray | None, int | None]:
    """A prompt as it crosses the pipe (as hypotheses do, without tensors)."""
    prefix, bos = prompt or Prompt()
    return (None if prefix is None else prefix.cpu().numpy()), bos


def _prompt_on(device: torch.device, prefix: np.ndarray | None, bos: int | None) -> Prompt:
    return Prompt(None if prefix is None else torch.from_numpy(prefix).to(device), bos)


def _picklable(error: BaseException) -> BaseException:
    """``error`` itself if it can cross the pipe, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(repr(error))

"""Decoding in a process of its own, so that the server's event loop and the decoder do not
share one interpreter lock: the loop parses, encodes and answers on one core while the engine
decodes on another.

The child process loads the models and runs a :class:`~beamplugin.streams.TranslationStream`;
:func:`relay` connects it to a pipe. The parent holds a :class:`DecoderProcess`, which has the
stream's interface as the server uses it (``submit_together`` returning futures, ``queued``,
``in_flight``, ``completed``, ``failure``, ``close``) and counts what it has sent, so a full
queue is refused in the parent without a round trip.

The child ignores SIGTERM and SIGINT (process managers signal the whole group): the parent
decides when to stop, with ``close``, and the child then finishes every accepted sentence. A
child that dies (killed, out of memory) fails every sentence it had, and later ones, with
:class:`~beamplugin.streams.StreamFailed`; one that cannot start raises its error in the parent.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from beamplugin.search.nbest import Hypothesis
from beamplugin.serving.loading import DecoderSettings, decoding_device, load_decoder
from beamplugin.streams import QueueFull, StreamClosed, StreamFailed, TranslationStream

if TYPE_CHECKING:
    from omegaconf import DictConfig


logger = logging.getLogger(__name__)


class DecoderProcess:
    """A TranslationStream decoding in a child process; at most ``max_queued`` sentences wait
    for room in its engine (beyond that ``submit_together`` raises QueueFull)."""

    def __init__(self, cfg: DictConfig, max_queued: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(cfg, max_queued, child_end), name="beamplugin-decoder"
        )
        self._process.start()
        child_end.close()  # so that the child's end closes when the child exits
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"the decoder process exited while starting (exit code {self._process.exitcode})"
            ) from None
        if kind == "failed":
            self._process.join()
            raise payload
        self.settings: DecoderSettings = payload
        self.max_queued = max_queued
        self._futures: dict[int, Future] = {}  # sent, not answered yet
        self._next_key = 0
        self._lock = threading.Lock()  # submits against each other and against failure
        self._closed = False
        self.in_flight = 0  # as the child last reported it
        self.completed = 0
        self.failure: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="beamplugin-results", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        """The decoder process's."""
        return self._process.pid

    @property
    def queued(self) -> int:
        """Sentences accepted and not in flight yet."""
        return max(0, len(self._futures) - self.in_flight)

    def submit_together(self, sentences: list[Tensor]) -> list[Future]:
        """Futures of the sentences' hypotheses (best first), all queued or, with too few
        places free, none (QueueFull)."""
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
            futures = [Future() for _ in sentences]
            try:
                self._conn.send(("submit", [
                    (key, tokens.cpu().numpy()) for key, tokens in zip(keys, sentences, strict=True)
                ]))  # fmt: skip
            except OSError as error:  # the child is gone; the reader fails the rest
                raise StreamFailed(f"the decoder process is gone: {error!r}") from error
            self._futures.update(zip(keys, futures, strict=True))
        return futures

    def _check_open(self) -> None:
        if self.failure is not None:
            raise StreamFailed(f"the decoder failed: {self.failure!r}") from self.failure
        if self._closed:
            raise StreamClosed("the stream is closed")

    def _read(self) -> None:
        """Resolve futures as the child's answers come; on the child's end, fail what is left."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "closed":
                return
            kind, key, payload, in_flight, failed = message
            with self._lock:
                future = self._futures.pop(key)
                self.in_flight = in_flight
                self.completed += 1
                if failed and self.failure is None:
                    self.failure = payload
            if kind == "done":
                future.set_result([_tensors(h) for h in payload])
            else:
                future.set_exception(payload)
        self._process.join()
        self._fail(RuntimeError(f"the decoder process ended (exit code {self._process.exitcode})"))

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.set_exception(self.failure)

    def close(self, timeout: float | None = None) -> None:
        """Take no more sentences; return when those accepted are decoded and the child has
        exited."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self._conn.send(("close",))
                except OSError:
                    pass  # already gone: the reader has failed what it had
        self._reader.join(timeout)
        self._process.join(timeout)


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
        # engine's capacity: sentences, or fewer than its tokens): it never blocks the relay,
        # which would stop reading while the parent waits to send.
        room = max_queued + (settings.max_sentences or settings.max_tokens)
        stream = settings.stream(generator, room)
    except BaseException as error:
        conn.send(("failed", _picklable(error)))
        return
    # Everything alive now lives as long as the process: out of the cyclic garbage collector's
    # reach, its full collections walk only what decoding makes (demo model: 6-8 ms instead of
    # 130-140 ms, during which no sentence in flight advances).
    gc.collect()
    gc.freeze()
    conn.send(("ready", settings))
    relay(stream, conn, decoding_device(cfg))


def relay(stream: TranslationStream, conn: Connection, device: torch.device) -> None:
    """Decode on ``stream`` (on ``device``) the sentences that come through ``conn``; send
    back each result as it is ready; on ``("close",)`` (or the parent's end closing), finish
    what was accepted, answer it, then say so."""
    send_lock = threading.Lock()  # answers are sent from the stream's decoder thread

    def send(message: tuple) -> None:
        with send_lock:
            try:
                conn.send(message)
            except OSError:
                pass  # the parent is gone: nobody to answer

    def answer(key: int, future: Future) -> None:
        error = future.exception()
        failed = stream.failure is not None
        if error is None:
            payload = [_arrays(h) for h in future.result()]
            send(("done", key, payload, stream.in_flight, failed))
        else:
            send(("error", key, _picklable(error), stream.in_flight, failed))

    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] == "close":
            break
        for key, tokens in message[1]:
            try:
                future = stream.submit(torch.from_numpy(tokens).to(device))
            except StreamClosed as refused:  # the decoder failed earlier
                send(("error", key, _picklable(refused), stream.in_flight, True))
                continue
            future.add_done_callback(lambda f, key=key: answer(key, f))
    stream.close()
    send(("closed",))


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


def _picklable(error: BaseException) -> BaseException:
    """``error`` itself if it can cross the pipe, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(repr(error))

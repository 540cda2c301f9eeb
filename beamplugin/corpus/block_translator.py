"""A block of raw lines in, its translations out: the server's translator (the models, tokenizer
and BPE set up from fairseq-interactive's options, one stream with continuous batching), one per
worker, fed block after block. Several blocks may be translated at once from different threads:
their sentences share the stream, so the next block fills the engine while one finishes. With a
glossary, the terms found in a line put their targets in its translation as the server's
glossaries do (beamplugin.serving.glossary), and are counted.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from omegaconf import DictConfig
from torch import Tensor

from beamplugin.corpus.inputs import split_lines
from beamplugin.fairseq_plugin.line_input import RefusedLine
from beamplugin.search.constraints import Constraints
from beamplugin.serving.glossary import constraints_of
from beamplugin.serving.translator import Translator

# Sentences that may wait in front of the engine; a block's submits block beyond that.
MAX_QUEUED = 256
# Blocks a worker is given at once: while one's last sentences finish, the next one's fill the
# engine, and the next block is already there when one is done.
BLOCKS_AT_ONCE = 2


@dataclass(frozen=True)
class BlockResult:
    """A block's translations: ``output`` one line per input line (an empty one for a rejected
    line), ``rejected`` (index in the block, reason); how the worker fared: ``seconds`` from
    its first line taken to its last one translated, and the worker's totals so far."""

    output: bytes
    rejected: list[tuple[int, str]]
    worker: str
    seconds: float
    worker_lines: int
    worker_busy: float  # seconds during which it translated at least one block
    worker_cpu: float  # CPU seconds of its process (all threads) since its models were loaded
    peak_rss: int  # bytes
    terms_applied: int = 0  # glossary terms found in the block's lines (each once a line)


class BlockTranslator:
    """The models of ``cfg`` (fairseq-interactive's options) translating blocks, under
    ``glossary``'s (source, target) terms if any (ValueError for a term the model cannot
    match or write)."""

    def __init__(self, cfg: DictConfig, glossary: list[tuple[str, str]] | None = None) -> None:
        self.translator = Translator(cfg, MAX_QUEUED, in_process=True)
        self.glossary = self.translator.glossary(glossary) if glossary else None
        # -s/-t's pair (a multilingual model's language tokens for it), as fairseq-interactive
        self.pair = self.translator.languages.default
        self.prompt = self.translator.prompt(self.pair)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._active, self._busy, self._busy_since, self._lines = 0, 0.0, 0.0, 0
        self._cpu_loaded = time.process_time()

    def translate(self, data: bytes) -> BlockResult:
        """The translations of the lines in ``data`` (a block's bytes): each line's best
        hypothesis as fairseq-interactive's D- line shows it."""
        self._started()
        started = time.perf_counter()
        lines = split_lines(data)
        pending, rejected, terms = self._submit(lines)
        texts = [""] * len(lines)
        for index, source, future in pending:
            try:
                hypotheses = future.result()
            except ValueError as error:  # too long for the engine, or its constraints
                rejected.append((index, str(error)))
                continue
            texts[index] = self.translator.render(source, hypotheses[:1], self.pair)[0].text
        seconds = time.perf_counter() - started
        worker_lines, busy = self._finished(len(lines))
        cpu = time.process_time() - self._cpu_loaded
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        output = "".join(text + "\n" for text in texts).encode("utf-8")
        return BlockResult(
            output, sorted(rejected), self.name, seconds, worker_lines, busy, cpu, peak_rss, terms
        )

    def _submit(
        self, lines: list[bytes]
    ) -> tuple[list[tuple[int, Tensor, Future]], list[tuple[int, str]], int]:
        """Each line encoded and submitted to the stream (waiting while its queue is full), or
        refused: (index, source tokens, future), (index, reason), and the glossary terms
        found in the lines submitted."""
        pending, rejected, terms = [], [], 0
        stream, (prefix, bos) = self.translator.stream, self.prompt
        for index, raw in enumerate(lines):
            text = raw.decode("utf-8", "surrogateescape")
            try:
                source = self.translator.encode_line(text, self.pair)
            except RefusedLine as refusal:
                rejected.append((index, refusal.reason))
                continue
            constraints: Constraints | None = None
            if self.glossary is not None:
                found = self.glossary.find(self.translator.pieces(text))
                terms += len(found)
                constraints = constraints_of(found) or None
            future = stream.submit(source, prefix_tokens=prefix, bos=bos, constraints=constraints)
            pending.append((index, source, future))
        return pending, rejected, terms

    def _started(self) -> None:
        with self._lock:
            if not self._active:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _finished(self, lines: int) -> tuple[int, float]:
        """A block of ``lines`` lines done: the worker's lines and busy seconds so far."""
        with self._lock:
            self._active -= 1
            self._lines += lines
            now = time.perf_counter()
            self._busy += now - self._busy_since
            self._busy_since = now
            return self._lines, self._busy

    def close(self) -> None:
        self.translator.close()

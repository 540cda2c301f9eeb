"""A block of raw lines in, its translations out: the server's translator (the models, tokenizer
and BPE set up from fairseq-interactive's options, one stream with continuous batching), one per
worker, fed block after block. Several blocks may be translated at once from different threads:
their sentences share the stream, so the next block fills the engine while one finishes. With a
glossary, the terms found in a line (in each of its sentences with ``--split-sentences``, as the
server does for a document) put their targets in its translation as the server's glossaries do
(beamplugin.serving.glossary), and are counted.
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
from beamplugin.corpus.sentences import LineDocument
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
    # glossary terms found in the block's lines translated (each once a sentence)
    terms_applied: int = 0


class BlockTranslator:
    """The models of ``cfg`` (fairseq-interactive's options) translating blocks: each line a
    sentence, or with ``split_sentences`` a document cut into sentences
    (beamplugin.corpus.sentences); under ``glossary``'s (source, target) terms if any, found
    in each sentence (ValueError for a term the model cannot match or write)."""

    def __init__(
        self, cfg: DictConfig, split_sentences: bool = False,
        glossary: list[tuple[str, str]] | None = None,
    ) -> None:  # fmt: skip
        self.translator = Translator(cfg, MAX_QUEUED, in_process=True)
        self.split_sentences = split_sentences
        self.glossary = self.translator.glossary(glossary) if glossary else None
        # -s/-t's pair (a multilingual model's language tokens for it), as fairseq-interactive
        self.pair = self.translator.languages.default
        self.prompt = self.translator.prompt(self.pair)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._active, self._busy, self._busy_since, self._lines = 0, 0.0, 0.0, 0
        self._cpu_loaded = time.process_time()

    def translate(self, data: bytes) -> BlockResult:
        """The translations of the lines in ``data`` (a block's bytes): each line's (or each
        of its sentences') best hypothesis as fairseq-interactive's D- line shows it; a line
        with a sentence refused is rejected whole."""
        self._started()
        started = time.perf_counter()
        lines = [raw.decode("utf-8", "surrogateescape") for raw in split_lines(data)]
        documents = [self._document(line) for line in lines]
        units = [(index, unit) for index, doc in enumerate(documents) for unit in doc.units]
        pending, refused, unit_terms = self._submit(units)
        translated: list[str] = [""] * len(units)
        for number, source, future in pending:
            try:
                hypotheses = future.result()
            except ValueError as error:  # too long for the engine, or its constraints
                refused.append((number, str(error)))
                continue
            translated[number] = self.translator.render(source, hypotheses[:1], self.pair)[0].text
        rejected: dict[int, str] = {}  # by line: the reason of its first unit refused
        for number, reason in sorted(refused):
            rejected.setdefault(units[number][0], reason)
        texts, start = [], 0
        for index, document in enumerate(documents):
            end = start + len(document.units)
            texts.append("" if index in rejected else document.assemble(translated[start:end]))
            start = end
        seconds = time.perf_counter() - started
        worker_lines, busy = self._finished(len(lines))
        cpu = time.process_time() - self._cpu_loaded
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        output = "".join(text + "\n" for text in texts).encode("utf-8")
        # a line's terms: the sum of its sentences', counted where the line was translated
        terms = sum(count for (index, _), count in zip(units, unit_terms, strict=True)
                    if index not in rejected)  # fmt: skip
        return BlockResult(
            output, sorted(rejected.items()), self.name, seconds, worker_lines, busy, cpu, peak_rss,
            terms,
        )

    def _document(self, line: str) -> LineDocument:
        """``line`` as what is translated: itself, or its sentences."""
        if self.split_sentences:
            return LineDocument.split(line, self.pair[0], self.translator.fits)
        return LineDocument.whole(line)

    def _submit(
        self, units: list[tuple[int, str]]
    ) -> tuple[list[tuple[int, Tensor, Future]], list[tuple[int, str]], list[int]]:
        """Each unit (its line's index, its text) encoded and submitted to the stream (waiting
        while its queue is full) with its own glossary terms as constraints, or refused: (unit
        number, source tokens, future), (unit number, reason), and each unit's terms found."""
        pending, refused, terms = [], [], [0] * len(units)
        stream, (prefix, bos) = self.translator.stream, self.prompt
        for number, (_, text) in enumerate(units):
            try:
                source = self.translator.encode_line(text, self.pair)
            except RefusedLine as refusal:
                refused.append((number, refusal.reason))
                continue
            constraints: Constraints | None = None
            if self.glossary is not None:
                found = self.glossary.find(self.translator.pieces(text))
                terms[number] = len(found)
                constraints = constraints_of(found) or None
            future = stream.submit(source, prefix_tokens=prefix, bos=bos, constraints=constraints)
            pending.append((number, source, future))
        return pending, refused, terms

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

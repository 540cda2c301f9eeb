"""A corpus job: the blocks not done yet handed to a runner (in this process, or on Ray), each
one's translations written once when they come back (its part, then its manifest row), and an
input's output assembled once all its blocks are done.

Exactly once: only the driver writes, a block's part before its row, each atomically; a block
counts as done when its row matches its input and its part is there (or its input's output was
assembled), so a job stopped anywhere and started again translates each block not done and
writes the same bytes as a job never stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from beamplugin.corpus.block_translator import BlockResult
from beamplugin.corpus.inputs import Block, InputFile, read_blocks
from beamplugin.corpus.manifest import Manifest
from beamplugin.corpus.progress import Progress
from beamplugin.corpus.summary import Summary
from beamplugin.corpus.writer import OutputFiles


class Runner(Protocol):
    """What translates the blocks (beamplugin.corpus.local_runner, .ray_runner)."""

    @property
    def workers_alive(self) -> int: ...

    def run(self, blocks: Iterator[Block]) -> Iterator[tuple[Block, BlockResult]]:
        """Each block with its result, in the order they finish."""


class Job:
    """``inputs`` translated into ``directory`` (outputs named ``<input name>.<target_lang>``)
    under ``manifest``."""

    def __init__(
        self, inputs: list[InputFile], directory: Path, target_lang: str, manifest: Manifest
    ) -> None:
        self.sources, self.manifest = {s.name: s for s in inputs}, manifest
        self.files = {s.name: OutputFiles(directory, s.name, target_lang) for s in inputs}
        self.pending = {s.name: self._pending(s) for s in inputs}
        blocks = sum(len(s.block_sha256) for s in inputs)
        self.summary = Summary(len(inputs), sum(s.lines for s in inputs), blocks)
        self.summary.blocks_before = blocks - sum(map(len, self.pending.values()))
        self.lines_before = self.summary.lines - sum(
            self.sources[name].block_size(index)
            for name, indexes in self.pending.items() for index in indexes
        )  # fmt: skip

    def _pending(self, source: InputFile) -> list[int]:
        """The blocks of ``source`` not done yet."""
        files = self.files[source.name]
        if self.manifest.assembled(source) and files.output.exists():
            return []
        return [
            index for index in range(len(source.block_sha256))
            if not (self.manifest.done(source, index)
                    and files.part(source.first_line(index)).exists())
        ]  # fmt: skip

    def run(self, runner: Runner, bar: bool, driver_only: bool) -> Summary:
        """Translate what is not done with ``runner``; ``bar``: a progress bar, else log lines;
        ``driver_only``: this process only drives (its CPU time is the driver's cost)."""
        cpu = time.process_time()
        progress = Progress(self.summary.lines, self.lines_before, bar)
        try:
            for name, pending in self.pending.items():
                if not pending:
                    self._assemble(self.sources[name])
            for block, result in runner.run(self._blocks()):
                if self._write(block, result):
                    progress.advance(block.lines, runner.workers_alive)
        finally:
            progress.close()
        if driver_only:
            self.summary.driver_cpu = time.process_time() - cpu
        self.summary.rejected = sum(
            len(files.rejects.read_bytes().splitlines()) for files in self.files.values()
        )
        return self.summary

    def _blocks(self) -> Iterator[Block]:
        for name, source in self.sources.items():
            yield from read_blocks(source, list(self.pending[name]))  # a copy: _write shrinks it

    def _write(self, block: Block, result: BlockResult) -> bool:
        """``block``'s part and manifest row, unless it was written already (a second result
        of one block: the first one stands); whether they were."""
        pending = self.pending[block.input]
        if block.index not in pending:
            return False
        lines_out = result.output.count(b"\n")
        if lines_out != block.lines:  # a translation with a line break would shift the rest
            raise RuntimeError(
                f"{block.input}, lines from {block.first_line}: {lines_out} lines came back "
                f"for {block.lines}"
            )
        self.files[block.input].write_part(block.first_line, result.output)
        rejected = [[block.first_line + index, reason] for index, reason in result.rejected]
        self.manifest.record_block(block, {
            "lines_out": lines_out, "rejected": rejected, "worker": result.worker,
            "seconds": round(result.seconds, 3), "peak_rss_mib": result.peak_rss >> 20,
            "terms_applied": result.terms_applied,
        })  # fmt: skip
        self.summary.translated(block.lines, result)
        pending.remove(block.index)
        if not pending:
            self._assemble(self.sources[block.input])
        return True

    def _assemble(self, source: InputFile) -> None:
        """``source``'s output from its parts, unless that was done before."""
        files = self.files[source.name]
        if not (self.manifest.assembled(source) and files.output.exists()):
            first_lines = map(source.first_line, range(len(source.block_sha256)))
            files.assemble(first_lines, self.manifest.rejected(source))
            self.manifest.record_assembled(source)
        files.remove_parts()

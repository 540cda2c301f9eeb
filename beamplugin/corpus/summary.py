"""A job's summary: lines, lines rejected, blocks done now and before, time, each worker's
throughput (by the clock while it had blocks, and by its CPU time: on a shared machine the
clock mostly says how much CPU it got) and peak memory, what the driver cost a block against a
block's decoding, and with a glossary the terms it put in."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from beamplugin.corpus.block_translator import BlockResult

MIB = 1 << 20


@dataclass
class WorkerFigures:
    """One worker's blocks in this run, its totals as it last reported them, and its peak
    resident memory after its first block and after its last."""

    blocks: int = 0
    lines: int = 0
    busy: float = 0.0
    cpu: float = 0.0
    first_rss: int = 0
    last_rss: int = 0


@dataclass
class Summary:
    inputs: int
    lines: int
    blocks: int
    blocks_before: int = 0
    lines_translated: int = 0
    rejected: int = 0
    driver_cpu: float | None = None  # seconds, when the driver does nothing else
    glossary: bool = False  # terms_applied is reported
    terms_applied: int = 0  # in the lines translated now
    workers: dict[str, WorkerFigures] = field(default_factory=dict)
    block_seconds: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def translated(self, lines: int, result: BlockResult) -> None:
        """A block of ``lines`` lines translated in this run."""
        self.lines_translated += lines
        self.terms_applied += result.terms_applied
        self.block_seconds.append(result.seconds)
        worker = self.workers.setdefault(result.worker, WorkerFigures(first_rss=result.peak_rss))
        worker.blocks += 1
        # the worker's totals as of its latest block (results may come back out of order)
        worker.lines = max(worker.lines, result.worker_lines)
        worker.busy = max(worker.busy, result.worker_busy)
        worker.cpu = max(worker.cpu, result.worker_cpu)
        worker.last_rss = max(worker.last_rss, result.peak_rss)

    def report(self) -> list[str]:
        """The summary's lines."""
        seconds = time.perf_counter() - self.started
        lines = [
            f"{self.lines} lines of {self.inputs} input file(s) in {seconds:.1f} s: "
            f"{self.lines_translated} translated now "
            f"({self.lines_translated / max(seconds, 1e-9):.1f} lines/s), "
            f"{self.rejected} rejected",
            f"blocks: {self.blocks}, {len(self.block_seconds)} translated now, "
            f"{self.blocks_before} done before",
        ]
        if self.glossary:
            lines.append(f"glossary: {self.terms_applied} terms applied in the lines translated "
                         "now")  # fmt: skip
        for name, worker in sorted(self.workers.items()):
            lines.append(
                f"worker {name}: {worker.blocks} blocks, {worker.lines} lines, "
                f"{worker.lines / max(worker.busy, 1e-9):.1f} lines/s while busy "
                f"({worker.lines / max(worker.cpu, 1e-9):.1f} a CPU-second), peak RSS "
                f"{worker.first_rss / MIB:.0f} MiB after its first block, "
                f"{worker.last_rss / MIB:.0f} MiB after its last"
            )
        if self.driver_cpu is not None and self.block_seconds:
            per_block = self.driver_cpu / len(self.block_seconds)
            decoding = statistics.median(self.block_seconds)
            lines.append(
                f"driver: {1000 * per_block:.2f} ms of CPU a block, "
                f"{100 * per_block / decoding:.2f}% of a block's decoding "
                f"({1000 * decoding:.0f} ms, median)"
            )
        return lines

"""Ours or torch's, per kernel and shape: where a model's weights are made ready for decoding,
each of our kernels is timed against torch's path at that model's shapes (a few milliseconds,
once), and where ours is not faster torch's is used, the log saying so once.

The verdict is kept in a file per CPU, code version and shape beside the compiled kernels
(``<cache>/trials/``), written once by the first process that times it: every later process on
the machine reads it, so a noisy timing never makes two runs of one command take different
kernels (and give different bits). ``BEAMPLUGIN_ISA`` pins the choice: ours on the set it names,
torch's with ``off``, nothing timed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from beamplugin.kernels import instruction_sets, native_library

logger = logging.getLogger(__name__)

OURS, TORCHS = "ours", "torch"
# Rounds of a few calls of ours then torch's, the fastest round of each compared: the machine's
# drift hits both, and other work on it only ever adds time.
ROUNDS = 9
ROUND_SECONDS = 0.0005  # the least a round of one side runs (a trial takes some 10-30 ms)
# A trial that finds torch's faster is timed again, up to this many times in all, each side's
# fastest round kept: a burst of other work (which only adds time) must not hand a kernel to
# torch for good where ours is faster.
ATTEMPTS = 3
# The rows a product kernel is timed at against torch's for a weight's shape: a decoder step's
# at beam 5, and a batch's of 16 sentences.
TRIAL_ROWS = (5, 80)


class Trial(NamedTuple):
    """Our kernel and torch's path for one shape, and the inputs to time them on (a step's rows
    and a batch's, say): ``ours(*args)`` against ``torchs(*args)`` for each ``args``."""

    ours: Callable[..., Any]
    torchs: Callable[..., Any]
    inputs: Sequence[tuple[Any, ...]]


_verdicts: dict[tuple[str, tuple[Any, ...]], bool] = {}


def ours_is_faster(
    kernel: str,
    shape: tuple[Any, ...],
    trial: Callable[[], Trial],
    sides: str = "torch's kernel, ours",
) -> bool:
    """Whether ``kernel`` at ``shape`` takes our kernel: ours where the geometric mean of its
    time over torch's on the ``trial()``'s inputs is below 1 (the trial made only where no
    verdict is kept yet). Decided once per CPU, code version and shape (kept on disk), and
    pinned by ``BEAMPLUGIN_ISA``. ``sides`` names the winner then the loser where ours loses
    (logged once)."""
    key = (kernel, shape)
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = instruction_sets.pinned() or _verdict(kernel, shape, trial, sides)
        _verdicts[key] = verdict
    return verdict


native_library.on_forget(_verdicts.clear)


def _verdict(kernel: str, shape: tuple[Any, ...], trial: Callable[[], Trial], sides: str) -> bool:
    name = f"{kernel}-{'x'.join(str(part) for part in shape)}"
    path = _folder() / f"{name}.txt"
    try:
        kept = path.read_text()
    except OSError:
        ours, torchs, inputs = trial()
        best = [(math.inf, math.inf)] * len(inputs)
        with torch.no_grad():
            for _ in range(ATTEMPTS):
                times = [_fastest(ours, torchs, args) for args in inputs]
                best = [(min(a, c), min(b, d)) for (a, b), (c, d) in zip(best, times, strict=True)]
                ratios = [ours_time / torchs_time for ours_time, torchs_time in best]
                ratio = math.exp(statistics.fmean(math.log(r) for r in ratios))
                if ratio < 1.0:
                    break
        kept = f"{OURS if ratio < 1.0 else TORCHS} {ratio:.3f} "
        kept += " ".join(f"{r:.3f}" for r in ratios) + "\n"
        kept = _write_once(path, kept)
    verdict, ratio, *_ = kept.split()
    if verdict != OURS:
        logger.info("%s %s: %s took x%s its time here (%s)", kernel, shape, sides, ratio, path)
    return verdict == OURS


def _fastest(
    ours: Callable[..., Any], torchs: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[float, float]:
    """Our time and torch's for one input (a call's): the fastest of interleaved rounds."""
    ours(*args), torchs(*args)  # warm: first-call allocations and packing
    start = time.perf_counter()
    ours(*args)
    calls = max(1, int(ROUND_SECONDS / max(time.perf_counter() - start, 1e-7)))
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(ROUNDS):
        for side, run in enumerate((ours, torchs)):
            start = time.perf_counter()
            for _ in range(calls):
                run(*args)
            times[side].append(time.perf_counter() - start)
    return min(times[0]) / calls, min(times[1]) / calls


def _folder() -> Path:
    """This CPU's and code version's folder of verdicts: our kernels' sources and set, torch's
    version, the CPU's model and features (not the threads: a command's bits must not depend
    on them)."""
    isa = instruction_sets.chosen()
    key = hashlib.sha256()
    for part in (
        native_library.sources_digest(),
        " ".join(instruction_sets.build_flags(isa)) if isa else "",
        torch.__version__,
        _cpu_model(),
        " ".join(sorted(instruction_sets.cpu_features())),
    ):
        key.update(part.encode())
    return native_library.cache_folder() / "trials" / key.hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor()


def _write_once(path: Path, text: str) -> str:
    """``text`` into ``path`` unless a process wrote it first: what the file holds then (the
    first writer's verdict stands), or ``text`` where nothing can be written there (logged)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text)
        try:
            os.link(partial, path)  # fails where the file exists
        except FileExistsError:
            pass
        finally:
            partial.unlink()
        return path.read_text()
    except OSError as error:
        logger.warning("kernel trial kept for this process only (%s)", error)
        return text

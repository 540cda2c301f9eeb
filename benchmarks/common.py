"""What every benchmark shares: the machine it ran on (CPU model and the flags that pick our
kernels, the kernel set, the GPU, the commit), timing, and the result records it appends to
``--results FILE`` (one JSON object a line, the schema of benchmarks/results/*.jsonl, which
``benchmarks/render_tables.py`` renders into README.md and docs/).

A speed figure holds only for the machine that measured it: each benchmark prints
:func:`cpu_description` above its table and every record carries :func:`machine`. torch and
beamplugin are imported where needed, not here: a CTranslate2 worker runs without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The CPU flags that decide which kernels run: float32 FMA width, int8 sums (VNNI, AMX),
# bfloat16 and float16 products.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip

# The fields of a record (README.md's "Results", docs/performance.md), None where not measured.
FIELDS = ("table", "row", "what", "system", "model", "precision", "batch", "sentences_per_s",
          "tokens_per_s", "ms_per_step", "peak_mib", "ratio", "same_as_reference", "command",
          "commit", "date", "device", "host_cpu", "cpu_flags", "kernels")  # fmt: skip


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of KERNEL_FLAGS it has (Linux's /proc/cpuinfo)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [flag for flag in KERNEL_FLAGS if flag in flags]


def kernel_set() -> str:
    """The set our float32 and int8 kernels were built for in this process ("off": torch's)."""
    from beamplugin.kernels import native_library

    ours = native_library.built_for("products")
    return ours if ours == "off" else f"{ours}, int8 {native_library.built_for('int8_products')}"


def cpu_description() -> str:
    """The CPU's model name and kernel flags and torch's CPU capability and our kernel set:
    printed with every speed figure, which holds only for that CPU."""
    import torch

    from beamplugin.kernels import instruction_sets

    model, flags = cpu_model_and_flags()
    present = " ".join(flags) or "flags unknown"
    capability = torch.backends.cpu.get_cpu_capability()
    ours = kernel_set()
    if ours != "off":
        ours += "" if instruction_sets.pinned() else ", each proven against torch's"
    return f"CPU {model} ({present}), torch CPU capability {capability}, our kernels {ours}"


def commit() -> str | None:
    """The commit that runs: ``BEAMPLUGIN_COMMIT`` where set (a copied tree may carry a stale
    .git), else git's HEAD, else None."""
    if os.environ.get("BEAMPLUGIN_COMMIT"):
        return os.environ["BEAMPLUGIN_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return None
    return head or None


def machine(device: str = "cpu", threads: int | None = None) -> dict[str, Any]:
    """The fields of a record that name where it ran: the device (the GPU's name, or the CPU's
    model, cores and threads), the host CPU under a GPU, the CPU flags, the kernel set, the
    commit and the date."""
    import torch

    model, flags = cpu_model_and_flags()
    if torch.device(device).type == "cuda":
        where, host, kernels = torch.cuda.get_device_name(device), model, "CUDA"
    else:
        where, host, kernels = f"{model}, {os.cpu_count()} cores", None, kernel_set()
        if threads:
            where += f", {threads} thread{'s' if threads > 1 else ''}"
    if host is None and model == "unknown CPU":
        where = f"{platform.machine()} {where}"
    return {"device": where, "host_cpu": host, "cpu_flags": " ".join(flags) or None,
            "kernels": kernels, "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}  # fmt: skip


def table_name(device: str = "cpu") -> str:
    """The results table a record of this process belongs to: "gpu", or "cpu-" and our kernels'
    set (avx512, avx2, neon, off)."""
    import torch

    from beamplugin.kernels import native_library

    if torch.device(device).type == "cuda":
        return "gpu"
    return f"cpu-{native_library.built_for('products')}"


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """``--results FILE``: where a benchmark appends its records."""
    parser.add_argument(
        "--results", type=Path, metavar="FILE",
        help="append one JSON line a measurement here (the schema of benchmarks/results/)",
    )  # fmt: skip


def command_line() -> str:
    """The command that reproduces this run, as records cite it: the variables that pin kernel
    sets, ``python -m benchmarks.NAME`` and the options, less ``--results``/``--profile`` and
    their files (where it wrote is not what it measured)."""
    module = sys.modules["__main__"].__spec__.name
    args = sys.argv[1:]
    shown = [a for a, before in zip(args, ["", *args], strict=False)
             if a not in ("--results", "--profile") and before not in ("--results", "--profile")]
    quoted = [f'"{a}"' if " " in a else a for a in shown]
    pinned = " ".join(f"{name}={os.environ[name]}" for name in ISA_VARIABLES if name in os.environ)
    return " ".join(filter(None, [pinned, "python -m", module, *quoted]))


# The variables that hold kernels to a set (docs/performance.md): part of the command.
ISA_VARIABLES = ("BEAMPLUGIN_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "CT2_FORCE_CPU_ISA")


def record(**fields: Any) -> dict[str, Any]:
    """A record with every field of FIELDS (None where not given) and any others given."""
    return {**dict.fromkeys(FIELDS), **fields}


def append_records(path: Path | None, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` to ``path``, one JSON line each (nothing where ``path`` is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        for one in records:
            out.write(json.dumps(one) + "\n")


def fastest(
    run: Callable[[], object],
    seconds: float = 0.004,
    rounds: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Microseconds a call: the fastest of ``rounds`` rounds of about ``seconds`` each, timed
    by ``clock`` (``time.thread_time`` leaves out a loaded machine's preemptions)."""
    run()
    start = clock()
    run()
    calls = max(1, int(seconds / max(clock() - start, 1e-7)))
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for _ in range(calls):
            run()
        best = min(best, (clock() - start) / calls)
    return best * 1e6


def peak_resident_mib() -> float | None:
    """This process's peak resident memory in MiB: Linux's VmHWM, None where there is none.
    Not ``getrusage``'s ``ru_maxrss``: that survives exec, so a worker would report at least
    the resident memory its parent had when it started it."""
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def in_own_process(module: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Run benchmark ``module`` (``benchmarks.NAME``) with ``args`` in a process of its own, this
    repository importable whatever the working directory, with ``env`` added to the
    environment; its standard output, or SystemExit with the end of its standard error."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}
    done = subprocess.run([sys.executable, "-m", module, *args], env=environment,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{module} {' '.join(args)} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")  # fmt: skip
    return done.stdout.splitlines()

"""The instruction sets our C kernels are written for, and the one this process runs: decided
once, here, from the CPU's features (not from what a compiler's ``-march=native`` makes of a CPU
it may not know), or pinned with ``BEAMPLUGIN_ISA``.

Each set has its own header (``native/isa/<name>.h``: its vectors and register tiles; the int8
products' code in ``native/int8/``) and its own compiler target flags; every kernel is built once
per set it runs on (beamplugin.kernels.native_library). A new set: a header beside the others, an
:class:`InstructionSet` in :data:`SETS` (docs/architecture.md, "add an instruction set").
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import NamedTuple

logger = logging.getLogger(__name__)

CHOICE = "BEAMPLUGIN_ISA"  # avx512, avx2, neon, generic: that set; off: torch's kernels only
OFF = "off"
AMX = "amx"  # BEAMPLUGIN_ISA=amx: avx512, its bfloat16 products on AMX tiles (avx512: never)
LEGACY_SWITCH = "BEAMPLUGIN_NATIVE"  # "0": as BEAMPLUGIN_ISA=off (its name before the sets)


class InstructionSet(NamedTuple):
    """A set our kernels are built for: its name (``native/isa/<name>.h``), the machines it
    runs on (``platform.machine()``), the CPU features it needs (as /proc/cpuinfo names them),
    the compiler flags that build for it, and optional extensions: a feature and the flag that
    lets a kernel use it where the CPU has it (AVX512-VNNI's int8 products)."""

    name: str
    machines: frozenset[str]
    requires: frozenset[str]
    flags: tuple[str, ...]
    extensions: tuple[tuple[str, str], ...] = ()


_X86 = frozenset({"x86_64", "AMD64"})
# x86-64-v3's features (GCC may use any of them in code built for the level)
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"})

AVX512 = InstructionSet(
    "avx512",
    _X86,
    _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    ("-march=x86-64-v4", "-ffp-contract=fast"),
    (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16")),
)
AVX2 = InstructionSet("avx2", _X86, _V3, ("-march=x86-64-v3", "-ffp-contract=fast"))
NEON = InstructionSet(
    "neon", frozenset({"aarch64", "arm64"}), frozenset({"asimd"}), ("-ffp-contract=fast",)
)
# Any CPU: no target flags, and a multiply-add is two roundings (as on x86-64's baseline)
GENERIC = InstructionSet("generic", frozenset(), frozenset(), ("-ffp-contract=off",))

SETS = (AVX512, AVX2, NEON, GENERIC)  # best first

# AMX's bfloat16 tiles: the features a CPU needs, the flags that build for them, and the sources
# that use them (built with those flags, beside the AVX-512 set's, only where the CPU has them)
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16"})
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
AMX_SOURCES = frozenset({"bf16_amx"})


def cpu_features() -> frozenset[str]:
    """The CPU's features as Linux lists them (x86's ``flags``, AArch64's ``Features``); none
    where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def runs_here(isa: InstructionSet, features: frozenset[str] | None = None) -> bool:
    """Whether this machine runs code built for ``isa``."""
    features = cpu_features() if features is None else features
    machine_fits = not isa.machines or platform.machine() in isa.machines
    return machine_fits and isa.requires <= features


def build_flags(isa: InstructionSet, features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The compiler flags for ``isa`` on this CPU: the set's, its extensions the CPU has, and the
    macro that picks the set's header."""
    features = cpu_features() if features is None else features
    extra = tuple(flag for feature, flag in isa.extensions if feature in features)
    return (*isa.flags, *extra, f"-DBEAMPLUGIN_ISA_{isa.name.upper()}")


def source_flags(
    isa: InstructionSet, source: str, features: frozenset[str] | None = None
) -> tuple[str, ...]:
    """The flags ``source`` (a kernel's file name without ``.c``) takes beyond ``isa``'s here:
    AMX's for the AMX kernels, built for AVX-512 on a CPU with AMX; none elsewhere."""
    features = cpu_features() if features is None else features
    if source in AMX_SOURCES and isa == AVX512 and AMX_FEATURES <= features:
        return AMX_FLAGS
    return ()


def amx_allowed() -> bool:
    """Whether bfloat16 products may run on AMX tiles: the AVX-512 set chosen on a CPU with AMX,
    and ``BEAMPLUGIN_ISA`` unset or ``amx`` (``avx512`` pins AVX512-BF16's products)."""
    name = os.environ.get(CHOICE, "").strip().lower()
    return (
        name in ("", AMX) and chosen() == AVX512 and AMX_FEATURES <= cpu_features()
    )


def by_name(name: str) -> InstructionSet:
    """The set called ``name``; a ValueError naming the choices for anything else."""
    for isa in SETS:
        if isa.name == name:
            return isa
    names = ", ".join(isa.name for isa in SETS)
    raise ValueError(f"{CHOICE}={name!r}: expected one of {names}, {AMX} or {OFF}")


def pinned() -> bool:
    """Whether ``BEAMPLUGIN_ISA`` (or ``BEAMPLUGIN_NATIVE=0``) decides, rather than this CPU's
    features and the kernels' timings against torch's."""
    return bool(os.environ.get(CHOICE)) or os.environ.get(LEGACY_SWITCH) == "0"


def chosen() -> InstructionSet | None:
    """The set this process's kernels are built for, None for torch's kernels only: the one
    ``BEAMPLUGIN_ISA`` names, else the best this CPU runs. Decided once a process (logged)."""
    return _chosen(os.environ.get(CHOICE, "").strip().lower(), os.environ.get(LEGACY_SWITCH))


@functools.cache
def _chosen(name: str, legacy: str | None) -> InstructionSet | None:
    if name == OFF or (not name and legacy == "0"):
        logger.info("native kernels off (%s=%s): torch's kernels", CHOICE, name or OFF)
        return None
    features = cpu_features()
    if name:
        isa = AVX512 if name == AMX else by_name(name)
        needs = isa.requires | (AMX_FEATURES if name == AMX else frozenset())
        if not runs_here(isa, features) or not needs <= features:
            missing = " ".join(sorted(needs - features)) or platform.machine()
            logger.warning("%s=%s, but this CPU lacks %s: torch's kernels", CHOICE, name, missing)
            return None
        logger.info("native kernels for %s (%s=%s)", isa.name, CHOICE, name)
        return isa
    isa = next(isa for isa in SETS if runs_here(isa, features))
    logger.info("native kernels for %s, the best this CPU runs", isa.name)
    return isa


def forget() -> None:
    """Decide again at the next :func:`chosen` (after ``BEAMPLUGIN_ISA`` changed: tests)."""
    _chosen.cache_clear()

"""C code of ours compiled on the machine that runs it, for the instruction set this process
runs (beamplugin.kernels.instruction_sets), and loaded with ctypes.

A source in ``beamplugin/kernels/native/`` is compiled once per source, headers, compiler and
set (its target flags: ``-march=x86-64-v4`` for AVX-512, ``-march=x86-64-v3`` for AVX2, none for
generic; never ``-march=native``, which a compiler may map to a tuning it does not know) into a
cache folder, then loaded from there by every later process. No build step at install time and
no Python or torch headers: a C compiler is all it needs, and it takes well under a second.
Without one, or with ``BEAMPLUGIN_ISA=off``, :func:`load` says why in the log and returns None,
and callers keep torch's own kernels. Why not ``torch.utils.cpp_extension`` or cffi:
docs/dependencies.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from beamplugin.kernels import instruction_sets
from beamplugin.kernels.instruction_sets import InstructionSet

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "native"
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")  # and the set's (instruction_sets.build_flags)
# C types of the kernels' arguments
POINTER, SIZE, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Below this many multiply-adds a kernel call runs on one thread: starting the others costs more
# (2 threads, AVX512 EPYC: 5 rows of 1024 x 256, 0.26M, 10.9 against 6.4 us; 5 x 256 x 256,
# 0.33M, 5.2 against 4.5 us; docs/speed.md).
PARALLEL_WORK = 1 << 17
CACHE = "BEAMPLUGIN_CACHE"  # where compiled libraries are kept (default ~/.cache/beamplugin)

_F = TypeVar("_F", bound=Callable[..., Any])
_FORGET: list[Callable[[], None]] = []  # what :func:`forget` clears


def cached(lookup: _F) -> _F:
    """A kernel lookup (a kernel module's ``_kernel()``) made once a process, until
    :func:`forget`."""
    once = functools.cache(lookup)
    _FORGET.append(once.cache_clear)
    return once  # type: ignore[return-value]


def on_forget(clear: Callable[[], None]) -> None:
    """``clear()`` at every :func:`forget` (what a module keeps of the kernels it chose)."""
    _FORGET.append(clear)


def forget() -> None:
    """Choose the set and look every kernel up again (after ``BEAMPLUGIN_ISA`` or the cache
    folder changed: tests and benchmarks)."""
    instruction_sets.forget()
    _load.cache_clear()
    _build_every_source.cache_clear()
    _compiler.cache_clear()
    for clear in _FORGET:
        clear()


def cache_folder() -> Path:
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "beamplugin"


def load(name: str, isa: InstructionSet | None = None) -> ctypes.CDLL | None:
    """The library built from ``native/<name>.c`` for ``isa`` (default: the set this process
    runs), or None (logged once) where it cannot be built here or the kernels are off."""
    isa = isa or instruction_sets.chosen()
    if isa is None:
        return None
    return _load(name, isa, os.environ.get("CC", "cc"))


def function(
    name: str,
    symbol: str,
    argtypes: Sequence[Any],
    restype: Any = None,
    isa: InstructionSet | None = None,
) -> Callable[..., Any] | None:
    """``symbol`` of the library :func:`load` gives for ``name``, with its C signature (None
    where the library cannot be built here)."""
    library = load(name, isa)
    if library is None:
        return None
    kernel = getattr(library, symbol)
    kernel.argtypes, kernel.restype = list(argtypes), restype
    return kernel


def function_for_this_cpu(
    name: str, available: str, symbol: str, argtypes: Sequence[Any], restype: Any = None
) -> Callable[..., Any] | None:
    """:func:`function`'s ``symbol``, where the library's ``available()`` says this build has
    the instructions it needs (files that need AVX512-BF16, say, export only that elsewhere)."""
    check = function(name, available, [], ctypes.c_int)
    if check is None or not check():
        return None
    return function(name, symbol, argtypes, restype)


def address(name: str, symbol: str) -> int | None:
    """Where ``symbol`` of :func:`load`'s library for ``name`` is, for C code that calls it (None
    where the library cannot be built here); its ctypes signature is left as it is."""
    library = load(name)
    return None if library is None else ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value


def built_for(name: str) -> str:
    """The set (and int8 code) ``name``'s library was built for, as it says itself: what the
    log and the benchmarks print; "off" where it is not built."""
    described = function(name, "instruction_set", [], ctypes.c_char_p)
    return "off" if described is None else described().decode()


def threads_for(work: int) -> int:
    """The threads a kernel call of ``work`` multiply-adds takes: torch's, or 1 below
    :data:`PARALLEL_WORK`."""
    return torch.get_num_threads() if work >= PARALLEL_WORK else 1


@functools.cache
def _load(name: str, isa: InstructionSet, compiler: str) -> ctypes.CDLL | None:
    built = _build_every_source(isa, compiler)[name]
    if isinstance(built, Exception):
        logger.warning("native kernels unavailable (%s): torch's kernels instead", built)
        return None
    try:
        return ctypes.CDLL(str(built))
    except OSError as error:
        logger.warning("native kernels unavailable (%s): torch's kernels instead", error)
        return None


@functools.cache
def _build_every_source(isa: InstructionSet, compiler: str) -> dict[str, Path | Exception]:
    """Every source of ours built for ``isa`` (those not in the cache yet, at once: a first run
    on a fresh machine waits for one compile instead of six in turn), or why it could not be."""

    def build(source: Path) -> Path | Exception:
        try:
            return _built(source, compiler, isa)
        except (OSError, subprocess.SubprocessError, RuntimeError) as error:
            return error

    sources = sorted(SOURCES.glob("*.c"))
    with ThreadPoolExecutor(max_workers=len(sources)) as pool:
        return dict(zip((s.stem for s in sources), pool.map(build, sources), strict=True))


@functools.cache
def sources_digest() -> str:
    """A digest of every source and header of our kernels: their code version."""
    key = hashlib.sha256()
    for path in sorted(SOURCES.rglob("*")):
        if path.suffix in (".c", ".h"):
            key.update(str(path.relative_to(SOURCES)).encode())
            key.update(path.read_bytes())
    return key.hexdigest()[:16]


@functools.cache
def _compiler(compiler: str) -> tuple[str, str]:
    """``compiler``'s path and its ``--version``: part of what a library was built with."""
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    version = subprocess.run(
        [path, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return path, version


def _built(source: Path, compiler: str, isa: InstructionSet) -> Path:
    """``source`` compiled for ``isa`` into the cache folder, unless it is there already."""
    extra = instruction_sets.source_flags(isa, source.stem)
    if not extra:
        return _compiled(source, compiler, isa, ())
    try:
        return _compiled(source, compiler, isa, extra)
    except RuntimeError as error:  # a compiler that does not know them: the file without them
        logger.info("%s without %s (%s)", source.name, " ".join(extra), error)
        return _compiled(source, compiler, isa, ())


def _compiled(source: Path, compiler: str, isa: InstructionSet, extra: tuple[str, ...]) -> Path:
    """``source`` compiled for ``isa``, with ``extra`` flags, into the cache folder, unless it is
    there already."""
    path, version = _compiler(compiler)
    flags = (*FLAGS, *instruction_sets.build_flags(isa), *extra)
    key = hashlib.sha256()
    for part in (source.name, sources_digest(), path, version, " ".join(flags)):
        key.update(part.encode())
    folder = cache_folder()
    library = folder / f"{source.stem}-{isa.name}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: processes building at once never load half a file
    handle, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(handle)
    try:
        done = subprocess.run(
            [path, *flags, "-o", partial, str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("compiled %s for %s into %s", source.name, isa.name, library)
    return library

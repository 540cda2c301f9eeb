"""Keep freed heap memory for reuse in a decoding process (glibc's allocator).

A decoder step allocates tensors of nearly the sizes of the step before. glibc's malloc, whose
thresholds follow the largest blocks freed so far, hands the top of the heap back to the kernel
and faults it in again a step later; fixed thresholds keep that memory, and blocks over the
largest mmap threshold glibc allows (a base transformer's logits at 64 sentences x beam 5, 41 MB)
come from the heap too instead of fresh mappings faulted in every step (figures:
docs/memory.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
# Blocks from this size on would get their own mapping (glibc's largest threshold): none do
# (M_MMAP_MAX 0), the heap serves them and keeps them for the next step.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap kept for reuse: a few steps' worth at any capacity.
TRIM_THRESHOLD = 256 << 20
# Settings of the user's that we leave alone.
USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES"
)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # not musl, not macOS


def give_back_free_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's ``malloc_trim``): after a one-off
    burst of allocations, such as a model's weights laid out for decoding (hundreds of MB freed
    in holes that the trim threshold never reaches); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds for this process and serve every block from the
    heap, once; False where the C library is not glibc or the user set them."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        and libc.mallopt(M_MMAP_MAX, 0)
    )
    if done:
        logger.debug("glibc malloc: freed heap memory is kept for reuse (up to 256 MB)")
    return bool(done)

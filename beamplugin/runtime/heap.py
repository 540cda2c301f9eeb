"""Keep freed heap memory for reuse in a decoding process (glibc's allocator).

A decoder step allocates tensors of nearly the same sizes as the step before (log-probs of
every row: 4.8 MB at 300 rows of a 4k vocabulary). glibc's malloc adapts its thresholds to the
largest blocks freed so far and hands the top of the heap back to the kernel whenever more
than twice that is free, so as sentences come and go and the sizes move a little, the heap
shrinks by 10-15 MB and grows again step after step, and every page that comes back is a page
fault: at capacity 64 on the demo model, 250,000-470,000 minor faults and 0.6-1.1 s of system
time per 1000 sentences (7-11% of the decode). Fixed thresholds keep that memory.
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
# Blocks above this still get their own mapping (glibc's largest dynamic value).
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap kept for reuse: a few steps' worth at any capacity.
TRIM_THRESHOLD = 256 << 20
# Settings of the user's that we leave alone.
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds for this process, once; False where the C library
    is not glibc or the user set them."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library (musl, macOS)
        return False
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(
        M_TRIM_THRESHOLD, TRIM_THRESHOLD
    )
    if done:
        logger.debug("glibc malloc: freed heap memory is kept for reuse (up to 256 MB)")
    return bool(done)

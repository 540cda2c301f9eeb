"""Memory pages: what a tensor holds resident, and giving pages back once they are not needed.

- Weights read from a mapped checkpoint (beamplugin.fairseq_plugin.mapped_checkpoints) are the
  file's pages, counted in the process's resident memory once read. When our kernels carry a
  weight in their own layout, its float32 parameter is not read again while the model decodes:
  :func:`page_out` asks Linux to reclaim those pages (``MADV_PAGEOUT``). A clean page of the file
  is dropped and read back from the file if anything touches it again (an embedding row,
  fairseq's own forward), alone, without the pages around it; a page the process wrote to
  (copy on write) is swapped or kept, never lost. Memory that no file backs is left alone.
- Large buffers (:func:`zeros`) are anonymous mappings: zeros that take memory only where they
  are written (a self-attention history with room for steps it has not taken), and
  :func:`discard` gives written pages back, zeros again, when their values are not needed.

Other systems keep every page: these are Linux's calls.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import math
import mmap
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

MADV_RANDOM = 1  # mman-linux.h
MADV_DONTNEED = 4
MADV_PAGEOUT = 21  # Linux >= 5.4
# buffers from this size on are mappings of their own (zeros that take memory where written)
MAPPED_FROM_BYTES = 1 << 20


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class FileMappings:
    """The address ranges of this process that map a file, as ``/proc/self/maps`` lists them
    when made (read once: a model's weights are released against one snapshot)."""

    def __init__(self) -> None:
        ranges: list[tuple[int, int]] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    # a path, not an anonymous or special mapping ([heap], [stack], ...)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        start, end = (int(a, 16) for a in fields[0].split("-"))
                        ranges.append((start, end))
        except OSError:
            pass
        ranges.sort()
        self._starts = [start for start, _ in ranges]
        self._ranges = ranges

    def backs(self, start: int, end: int) -> bool:
        """Whether the bytes ``[start, end)`` lie in mappings of files, without a gap (an advice
        such as ``MADV_RANDOM`` splits one mapping into several)."""
        index = bisect.bisect_right(self._starts, start) - 1
        if index < 0:
            return False
        reach = self._ranges[index][1]
        while reach < end and index + 1 < len(self._ranges):
            index += 1
            if self._ranges[index][0] != reach:
                return False
            reach = self._ranges[index][1]
        return reach >= end


def _whole_pages(tensor: Tensor) -> tuple[int, int]:
    """The first and last addresses of the whole pages inside ``tensor``'s bytes (equal where
    there are none)."""
    page = mmap.PAGESIZE
    address = tensor.data_ptr()
    end = address + tensor.numel() * tensor.element_size()
    first, last = -(-address // page) * page, end // page * page
    return first, max(first, last)


def _advise(tensor: Tensor, advice: int, mappings: FileMappings | None = None) -> int:
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    first, last = _whole_pages(tensor)
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    if last == first or (mappings is not None and not mappings.backs(tensor.data_ptr(), end)):
        return 0
    if madvise(first, last - first, advice) != 0:
        ctypes.set_errno(0)  # e.g. EINVAL for MADV_PAGEOUT before Linux 5.4: the pages stay
        return 0
    return last - first


def page_out(tensor: Tensor, mappings: FileMappings) -> int:
    """Ask Linux to reclaim the whole pages of ``tensor``'s bytes where a file backs them (see
    module doc); returns how many bytes were asked for (0 where none were, or nothing can).
    Pages read again later come back one by one (``MADV_RANDOM``): what reads such a weight
    reads rows here and there (a token's embedding), and the readahead of each fault would
    bring most of a 1 GB projection back."""
    _advise(tensor, MADV_RANDOM, mappings)
    return _advise(tensor, MADV_PAGEOUT, mappings)


def discard(tensor: Tensor) -> int:
    """Give back the whole pages of ``tensor``'s bytes, which must be the caller's own anonymous
    memory (a :func:`zeros` buffer) whose values are no longer needed: they read as zeros
    again, and take memory once written. Returns the bytes given back (0 where none)."""
    return _advise(tensor, MADV_DONTNEED)


def zeros(shape: Sequence[int], like: Tensor) -> Tensor:
    """A tensor of zeros of ``like``'s dtype and device; on a Linux CPU, from
    :data:`MAPPED_FROM_BYTES` on, an anonymous mapping of its own whose pages take memory only
    once written (torch's zeros write every page)."""
    count = math.prod(shape)
    size = count * like.element_size()
    if like.device.type != "cpu" or size < MAPPED_FROM_BYTES or _madvise() is None:
        return like.new_zeros(shape)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps the mapping alive, and it is unmapped with the tensor
    return torch.frombuffer(mapping, dtype=like.dtype, count=count).view(*shape)

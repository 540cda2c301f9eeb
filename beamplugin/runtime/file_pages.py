"""Give back the pages of tensors that are read from a mapped file, once they are not needed.

A checkpoint loaded by mapping its file (beamplugin.fairseq_plugin.mapped_checkpoints) leaves
each weight in the file's pages, counted in the process's resident memory once read. When our
kernels carry a weight in their own layout, its float32 parameter is not read again while the
model decodes: :func:`page_out` asks Linux to reclaim those pages (``MADV_PAGEOUT``). A clean
page of the file is dropped and read back from the file if anything touches it again (an
embedding row, fairseq's own forward); a page the process wrote to (copy on write) is swapped
or kept, never lost. Memory that no file backs is left alone, and so is every other system.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import os
import sys

from torch import Tensor

MADV_PAGEOUT = 21  # Linux >= 5.4 (mman-linux.h)


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
        """Whether the bytes ``[start, end)`` lie in one mapping of a file."""
        index = bisect.bisect_right(self._starts, start) - 1
        return index >= 0 and self._ranges[index][1] >= end


def page_out(tensor: Tensor, mappings: FileMappings) -> int:
    """Ask Linux to reclaim the whole pages of ``tensor``'s bytes where a file backs them (see
    module doc); returns how many bytes were asked for (0 where none were, or nothing can)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    address = tensor.data_ptr()
    end = address + tensor.numel() * tensor.element_size()
    first, last = -(-address // page) * page, end // page * page
    if last <= first or not mappings.backs(address, end):
        return 0
    if madvise(first, last - first, MADV_PAGEOUT) != 0:
        ctypes.set_errno(0)  # EINVAL on kernels before 5.4: the pages simply stay
        return 0
    return last - first


def resident_file_bytes() -> int | None:
    """This process's resident pages of mapped files (``RssFile``), None where not listed."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

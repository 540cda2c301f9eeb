"""Large buffers lent out again and again in a decoding process, instead of allocated anew.

Large buffers are mappings of their own (runtime/pages.py: zeros), whose pages fault in on
first touch, every time: the self-attention history of a transformer at 64
sentences x beam 5 is 31-94 MB, and filling a fresh one took 45 ms and more on the machine we
measured, more than a whole decoder step (docs/memory.md). A pool lends such buffers through a
:class:`Lease`, which gives them back when its borrower drops it (a decoder's incremental state
at the end of a batch) or earlier, one by one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from torch import Tensor

from beamplugin.runtime import pages


class BufferPool:
    """Keeps up to ``keep`` buffers that no lease holds, the largest (a buffer serves any
    request it is large enough for, and a long sentence's tail returns many small ones)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[Tensor] = []
        # generators may decode in several threads; a lease's finalizer may run inside _take
        # (a collection during an allocation), in the thread that holds the lock: reentrant
        self._lock = threading.RLock()

    def lease(self) -> Lease:
        return Lease(self)

    def _take(self, shape: Sequence[int], like: Tensor, grows: Sequence[int]) -> Tensor | None:
        def fits(buffer: Tensor) -> bool:
            return (
                buffer.dtype == like.dtype
                and buffer.device == like.device
                and buffer.dim() == len(shape)
                and all(
                    have >= want if dim in grows else have == want
                    for dim, (have, want) in enumerate(zip(buffer.shape, shape, strict=True))
                )
            )

        with self._lock:
            fitting = [buffer for buffer in self._free if fits(buffer)]
            if not fitting:
                return None
            smallest = min(fitting, key=Tensor.numel)
            self._free = [buffer for buffer in self._free if buffer is not smallest]
            return smallest

    def _give_back(self, buffers: Sequence[Tensor]) -> None:
        with self._lock:
            self._free = sorted([*self._free, *buffers], key=Tensor.numel)[-self.keep :]


class Lease:
    """The buffers one borrower holds from a :class:`BufferPool`; they return to the pool
    when the lease is garbage collected, or one by one with :meth:`give_back`."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._held: list[Tensor] = []
        weakref.finalize(self, pool._give_back, self._held)

    def take(self, shape: Sequence[int], like: Tensor, grows: Sequence[int] = ()) -> Tensor:
        """A buffer of ``shape``, or larger along the dimensions ``grows``, of ``like``'s dtype
        and device. Its values are finite: zeros when new (taking memory only where written:
        beamplugin.runtime.pages.zeros), else what its last borrower wrote (borrowers write
        finite values only, or give pages back as zeros)."""
        buffer = self._pool._take(shape, like, grows)
        if buffer is None:
            buffer = pages.zeros(shape, like)
        self._held.append(buffer)
        return buffer

    def give_back(self, buffer: Tensor) -> None:
        """Return ``buffer`` (which the borrower no longer reads) to the pool now."""
        self._held[:] = [held for held in self._held if held is not buffer]
        self._pool._give_back([buffer])

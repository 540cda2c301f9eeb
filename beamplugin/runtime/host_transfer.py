"""Copies between the host and the search's device with at most one synchronisation each.

On CUDA, ``tensor.cpu()`` and ``torch.tensor(values, device=...)`` each wait for the device;
the search needs several tensors at once when hypotheses finish, and every wait empties the
queue of kernels the host has launched ahead. On the CPU both functions cost nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_host(*tensors: Tensor) -> list[Tensor]:
    """The tensors on the CPU, copied with one synchronisation in all."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    # Non-blocking copies to the CPU land in pinned memory and return at once; the last copy
    # blocks until the stream has caught up, which completes the earlier ones queued before it.
    *first, last = tensors
    return [*(t.to("cpu", non_blocking=True) for t in first), last.cpu()]


def to_device(
    values: list[int] | list[float] | Tensor,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``values`` (a host list or tensor) on ``device``, without waiting for the device: CUDA
    copies the few bytes of pageable memory into a staging buffer of its own before the call
    returns and queues the copy behind the kernels already launched (pinning each small list
    first cost more host time than it saved: docs/performance.md, "On a GPU")."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.to(device, non_blocking=True)

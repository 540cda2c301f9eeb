"""Counting, on the CPU, the host synchronisations a search would make on a GPU.

The sample's tensors become :class:`DeviceTensor`, a tensor subclass that every result computed
from them inherits, so they stand for the GPU's tensors; ``to_host`` / ``to_device`` of
``beamplugin.runtime.host_transfer`` are replaced by versions that take the subclass off and put
it on.
A call that would make the host wait for a GPU tensor (``.item()``, ``bool()``, ``.tolist()``,
``.cpu()``, ``nonzero``, a boolean-mask index) is recorded with the file and function that
made it; each ``to_host`` call counts as one.
"""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor

import beamplugin.engine.ensemble
import beamplugin.engine.finalizer
import beamplugin.engine.scheduler
import beamplugin.engine.slots
import beamplugin.modules.attention
import beamplugin.search.log_prob_rules
import beamplugin.search.stopping

# The modules that move tensors between the host and the device (with host_transfer's helpers).
TRANSFERRING_MODULES = [
    beamplugin.engine.ensemble,
    beamplugin.engine.finalizer,
    beamplugin.engine.scheduler,
    beamplugin.engine.slots,
    beamplugin.modules.attention,
    beamplugin.search.log_prob_rules,
    beamplugin.search.stopping,
]

T = Tensor
WAITING_CALLS = {
    T.item,
    T.tolist,
    T.cpu,
    T.numpy,
    T.__bool__,
    T.__int__,
    T.__float__,
    T.__index__,
    T.nonzero,
    torch.nonzero,
    T.masked_select,
    torch.masked_select,
}


class DeviceTensor(Tensor):
    """A CPU tensor that stands for a GPU tensor; see the module doc."""

    syncs: collections.Counter | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if cls.syncs is not None and _waits(func, args):
            cls.syncs[_caller()] += 1
        return super().__torch_function__(func, types, args, kwargs)


def _waits(func: Any, args: tuple) -> bool:
    if func in WAITING_CALLS:
        return True
    if func is T.__getitem__ and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index)
    return False


def _caller() -> str:
    """file:function of the innermost frame that is neither torch's nor this file's."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and os.path.basename(path) != "host_syncs.py":
            return f"{os.path.basename(path)}:{frame.name}"
    return "?"


def as_device(sample: Any) -> Any:
    if isinstance(sample, Tensor):
        return sample.as_subclass(DeviceTensor)
    if isinstance(sample, dict):
        return {key: as_device(value) for key, value in sample.items()}
    return sample


@contextmanager
def counting_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter]:
    """Counts, by call site, the synchronisations of searches run inside (on ``as_device``
    samples)."""
    syncs: collections.Counter = collections.Counter()

    def to_host(*tensors: Tensor) -> list[Tensor]:
        syncs[f"to_host from {_caller()}"] += 1
        return [t.as_subclass(Tensor) for t in tensors]

    def to_device(values: Any, device: Any, dtype: Any = None) -> Tensor:
        host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
        return host.as_subclass(DeviceTensor)

    for module in TRANSFERRING_MODULES:
        if hasattr(module, "to_host"):
            monkeypatch.setattr(module, "to_host", to_host)
        if hasattr(module, "to_device"):
            monkeypatch.setattr(module, "to_device", to_device)
    DeviceTensor.syncs = syncs
    try:
        yield syncs
    finally:
        DeviceTensor.syncs = None

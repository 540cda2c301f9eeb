"""Load fairseq checkpoints under torch's ``weights_only`` unpickler, and nothing else.

torch >= 2.6 refuses fairseq checkpoints by default because they pickle an
``argparse.Namespace``. Rather than switching the safe unpickler off, we allowlist the few
Python objects that fairseq checkpoints really hold and refuse any other, naming it, before a
single byte is unpickled.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fairseq import checkpoint_utils


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint that is corrupt or holds objects a fairseq checkpoint never contains."""


def _numpy_scalar_globals() -> list[Any]:
    # fairseq may store `best`/`val_loss` as numpy scalars; unpickling one needs the scalar
    # constructor and the dtype classes, never arbitrary code. Files written under numpy 1.x
    # name the constructor numpy.core.multiarray.scalar.
    scalar = np._core.multiarray.scalar
    dtype_classes = [type(np.dtype(t)) for t in ("float16", "float32", "float64", "int32", "int64")]
    return [scalar, (scalar, "numpy.core.multiarray.scalar"), np.dtype, *dtype_classes]


FAIRSEQ_CHECKPOINT_GLOBALS: list[Any] = [argparse.Namespace, *_numpy_scalar_globals()]


def allow_fairseq_checkpoints() -> None:
    """Register the objects fairseq checkpoints contain with torch's safe unpickler."""
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)


def check_checkpoint(path: str | os.PathLike) -> None:
    """Raise UnsafeCheckpointError if ``path`` is unreadable or pickles a foreign object.

    Only scans the pickle's opcodes: nothing in the file is executed. Objects count as foreign
    unless torch allows them by default or ``allow_fairseq_checkpoints`` registered them.
    """
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
        raise UnsafeCheckpointError(
            f"{path}: not a readable PyTorch checkpoint (corrupt or truncated?): {err}"
        ) from err
    foreign = sorted(set(found))
    if foreign:
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: the checkpoint pickles {', '.join(foreign)}, which no "
            "fairseq checkpoint contains. Loading it could run arbitrary code. If you trust the "
            "file, convert it yourself with torch.load(weights_only=False) and re-save only its "
            "tensors and plain values."
        )


def _checked_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_checked(path: str, *args: Any, **kwargs: Any) -> Any:
        check_checkpoint(path)
        return load(path, *args, **kwargs)

    load_checked.__beamplugin_checked__ = True  # type: ignore[attr-defined]
    return load_checked


def install() -> None:
    """Make fairseq's own checkpoint loading (fairseq-generate, -interactive, -train) safe."""
    allow_fairseq_checkpoints()
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "__beamplugin_checked__", False):
        checkpoint_utils.load_checkpoint_to_cpu = _checked_loader(
            checkpoint_utils.load_checkpoint_to_cpu
        )

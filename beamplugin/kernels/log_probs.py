"""The decoder's log-probabilities on the CPU through our kernel (``native/log_softmax.c``):
float32 logits replaced in place by ``torch.log_softmax``'s values (within a few ulp), in one
fused kernel per row instead of torch's max, exp-sum and subtraction. A row's bits are its own,
whatever the rows beside it and the threads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from beamplugin.kernels import native_library, trials
from beamplugin.kernels.native_library import INT, POINTER, SIZE, threads_for
from beamplugin.kernels.trials import TRIAL_ROWS, Trial


@native_library.cached
def _kernel() -> Callable[..., Any] | None:
    return native_library.function("log_softmax", "log_softmax", [POINTER, SIZE, SIZE, SIZE, INT])


def log_softmax_(logits: Tensor, vocab: int | None = None) -> bool:
    """``logits`` (float32 on the CPU, ``[..., width]``, rows of consecutive words) replaced by
    their log-softmax over the last dimension, where our kernel is built here and faster than
    torch's at ``vocab`` words (default ``width``; beamplugin.kernels.trials); False, nothing
    written, where it is not: the caller's ``torch.log_softmax`` then. Rows of a shortlist's
    columns pass the model's vocabulary: their kernel then is the whole rows', whatever their
    width, and a row padded with -inf keeps its bits."""
    if logits.dtype != torch.float32 or not logits.is_cpu or logits.numel() == 0:
        return False
    rows = logits.view(-1, logits.size(-1)) if logits.is_contiguous() else logits
    if rows.dim() != 2 or rows.stride(1) != 1 or _kernel() is None:
        return False
    words = vocab or rows.size(1)
    if not trials.ours_is_faster("log_softmax", (words,), lambda: trial(words)):
        return False
    _apply(rows)
    return True


def _apply(rows: Tensor) -> None:
    kernel = _kernel()
    assert kernel is not None
    count, vocab = rows.shape
    kernel(rows.data_ptr(), count, vocab, rows.stride(0), threads_for(count * vocab))


def trial(vocab: int) -> Trial:
    """Ours against torch's in-place log-softmax, at a step's rows (beam 5) and a batch's."""
    inputs = [(torch.randn(rows, vocab),) for rows in TRIAL_ROWS]

    def torchs(logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, -1, out=logits)

    return Trial(_apply, torchs, inputs)

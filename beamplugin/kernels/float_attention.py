"""A transformer decoder step's attention (one query per row and head) in one call per layer,
float32 on the CPU, through our kernel (``native/attention.c``).

With torch, a layer's self-attention and cross-attention take some 30 operations at a decoder
step (the history write, views, ``baddbmm``, softmax, ``bmm``, reshapes), each costing 1-6 us
whatever its size, where the arithmetic at a few rows takes a few microseconds
(docs/speed.md). Each row and head is computed alone, in an order that does not depend on the
rows beside it, the buffers' widths or the threads, so a sentence gets the same bits alone or
batched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from beamplugin.kernels import native_library, trials
from beamplugin.kernels.native_library import INT, POINTER, SIZE, threads_for
from beamplugin.kernels.trials import Trial


@native_library.cached
def _kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """attention.c's ``self_attention`` and ``cross_attention`` (None where it cannot be
    built)."""
    own = [POINTER, SIZE, POINTER, POINTER, SIZE, SIZE, POINTER, SIZE, POINTER, POINTER]
    own += [POINTER, SIZE, SIZE, SIZE, SIZE, INT]
    cross = [POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, POINTER, SIZE, SIZE, POINTER, SIZE]
    cross += [POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, INT]
    self_attention = native_library.function("attention", "self_attention", own, ctypes.c_int)
    cross_attention = native_library.function("attention", "cross_attention", cross)
    if self_attention is None or cross_attention is None:
        return None
    return self_attention, cross_attention


def serves(x: Tensor, heads: int, head_dim: int) -> bool:
    """Whether ``x``'s attention over ``heads`` of ``head_dim`` runs here: float32, on the CPU,
    without autograd, and :func:`taken` at that shape."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and taken(heads, head_dim)
    )


def taken(heads: int, head_dim: int) -> bool:
    """Whether our kernels are built and faster than torch's for attention over ``heads`` of
    ``head_dim`` (beamplugin.kernels.trials)."""
    return _kernels() is not None and trials.ours_is_faster(
        "attention", (heads, head_dim), lambda: trial(heads, head_dim)
    )


def trial(heads: int, head_dim: int, rows: int = 5, width: int = 16, src: int = 24) -> Trial:
    """A decoder step's two attentions (``rows`` of one sentence, ``width`` steps of history,
    ``src`` source positions) by our kernels against torch's batched products and softmax."""
    embed = heads * head_dim
    qkv = torch.randn(rows, 3 * embed)
    keys, values = torch.randn(2, rows, heads, width, head_dim)
    sources = torch.arange(rows).unsqueeze(1).expand(rows, width).contiguous()
    bias = torch.zeros(rows, width)
    memory = torch.randn(1, heads, head_dim, src), torch.randn(1, heads, src, head_dim)
    pad = torch.zeros(1, 1, 1, src)

    def ours() -> None:
        self_attention(qkv, keys, values, sources, bias)
        cross_attention(qkv[:, :embed], *memory, pad, torch.empty(rows, embed), False)

    def torchs() -> None:
        q = qkv[:, :embed].reshape(rows * heads, 1, head_dim)
        for k, v in ((keys, values), (memory[0].transpose(2, 3), memory[1])):
            k = k.expand(rows, heads, -1, head_dim).reshape(rows * heads, -1, head_dim)
            v = v.expand(rows, heads, -1, head_dim).reshape(rows * heads, -1, head_dim)
            scores = torch.baddbmm(bias.new_zeros(1, 1, k.size(1)), q, k.transpose(1, 2))
            torch.bmm(scores.softmax(-1), v).view(rows, embed)

    return Trial(ours, torchs, [()])


def self_attention(
    qkv: Tensor, keys: Tensor, values: Tensor, sources: Tensor, bias: Tensor
) -> Tensor:
    """fairseq's incremental self-attention of each row of ``qkv`` ``[rows, 3 x embed]`` (its
    scaled query, key and value) over its history: ``keys``, ``values`` ``[slots, heads, width,
    head_dim]`` (a layer's, columns ``head_dim`` apart), row ``r``'s column ``j`` in slot
    ``sources[r, j]`` (``[rows, width]`` int64); this step's key and value are written first
    into slot ``r``'s last column, which must be row ``r``'s. ``bias`` ``[rows, width]``: 0, or
    -inf where masked. Returns the context ``[rows, embed]``."""
    kernels = _kernels()
    assert kernels is not None, "check serves() first"
    slots, heads, width, head_dim = keys.shape
    rows = qkv.size(0)
    if values.shape != keys.shape or qkv.shape != (rows, 3 * heads * head_dim):
        raise ValueError(f"qkv {tuple(qkv.shape)}, keys and values {tuple(keys.shape)} differ")
    if keys.stride()[2:] != (head_dim, 1) or values.stride() != keys.stride():
        raise ValueError("the history's columns must be head_dim floats apart")
    if qkv.stride(1) != 1 or not bias.is_contiguous() or bias.shape != (rows, width):
        raise ValueError("qkv's rows and the bias must be contiguous")
    if (
        sources.dtype != torch.int64
        or not sources.is_contiguous()
        or sources.shape != (rows, width)
    ):
        raise ValueError(f"sources must be [{rows}, {width}] contiguous int64")
    out = qkv.new_empty((rows, heads * head_dim))
    failed = kernels[0](
        qkv.data_ptr(),
        qkv.stride(0),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        sources.data_ptr(),
        slots,
        bias.data_ptr(),
        None,  # the weights: not wanted
        out.data_ptr(),
        rows,
        heads,
        head_dim,
        width,
        threads_for(rows * heads * width * head_dim),
    )
    if failed:
        raise ValueError(f"sources must be slots 0 to {slots - 1}, and rows {slots} at most")
    return out


def cross_attention(
    query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, out: Tensor, need_weights: bool
) -> Tensor | None:
    """fairseq's encoder-decoder attention of ``query`` ``[rows, embed]`` (scaled; rows sentence
    by sentence, the same number each) over the sentences' ``keys`` ``[sentences, heads,
    head_dim, src]`` and ``values`` ``[sentences, heads, src, head_dim]`` (views of a memory
    pool: source positions consecutive) with their padding ``bias`` ``[sentences, 1, 1, src]``
    (0 or -inf). The context goes into ``out`` ``[rows, embed]`` (contiguous rows); returns the
    weights averaged over heads ``[rows, src]`` if ``need_weights``."""
    kernels = _kernels()
    assert kernels is not None, "check serves() first"
    sentences, heads, head_dim, src = keys.shape
    rows = query.size(0)
    if values.shape != (sentences, heads, src, head_dim) or bias.shape != (sentences, 1, 1, src):
        raise ValueError(f"keys {tuple(keys.shape)}, values and bias of other shapes")
    if query.size(1) != heads * head_dim or out.shape != query.shape:
        raise ValueError(f"query and out must be [rows, {heads * head_dim}]")
    if keys.stride(3) != 1 or values.stride()[2:] != (head_dim, 1) or bias.stride(3) != 1:
        raise ValueError("the source positions of keys, values and bias must be consecutive")
    if query.stride(1) != 1 or out.stride() != (heads * head_dim, 1) or rows % sentences:
        raise ValueError("query and out must have contiguous rows, as many for each sentence")
    mean = query.new_empty((rows, src)) if need_weights else None
    kernels[1](
        query.data_ptr(),
        query.stride(0),
        keys.data_ptr(),
        *keys.stride()[:3],
        values.data_ptr(),
        *values.stride()[:2],
        bias.data_ptr(),
        bias.stride(0),
        None if mean is None else mean.data_ptr(),
        src,
        out.data_ptr(),
        rows,
        rows // sentences,
        heads,
        head_dim,
        src,
        threads_for(rows * heads * src * head_dim),
    )
    return mean

"""Float32 matrix products on the CPU through our own kernel (``native/products.c``).

At a decoder step's few rows torch's products cost mostly their call: oneDNN's matmul takes
about 12 us for any product, even 16 x 16, so a 3-layer transformer's 19 products a step spend
some 0.2 ms in calls alone (MKL and OpenBLAS have less overhead but run 2-4 times slower here).
This kernel is called through ctypes in about 1 us, reads each weight once from panels laid out
for it, and as fast as oneDNN from about 40 rows (docs/speed.md). Each output element is summed
in order over the inner dimension, so a row's result has the same bits whatever rows are beside
it and whatever the number of threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

from beamplugin.kernels import native_library
from beamplugin.kernels.native_library import FLOAT, INT, POINTER, SIZE, threads_for

PANEL = 32  # output features a panel holds (products.c's NR)


class Panels(NamedTuple):
    """A weight ``[out, in]`` packed for :func:`product`: ``[ceil(out / 32), in, 32]``."""

    values: Tensor
    out_features: int


@functools.cache
def _kernel() -> Callable[..., Any] | None:
    """products.c's ``products``, loaded once a process (None where it cannot be built)."""
    signature = [POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE]
    signature += [INT, POINTER, POINTER, FLOAT, INT]
    return native_library.function("products", "products", signature)


def available() -> bool:
    """Whether the kernel is built and loaded here (see beamplugin.kernels.native_library)."""
    return _kernel() is not None


def pack(weight: Tensor) -> Panels:
    """``weight`` (float32, ``[out, in]``) laid out in panels for :func:`product`."""
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    padded = weight.new_zeros(count * PANEL, in_features)
    padded[:out_features] = weight
    values = padded.view(count, PANEL, in_features).transpose(1, 2).contiguous()
    return Panels(values, out_features)


def product(
    x: Tensor,
    weight: Panels,
    bias: Tensor | None,
    residual: Tensor | None = None,
    relu: bool = False,
    norm: tuple[Tensor, Tensor, float] | None = None,
) -> Tensor:
    """``x @ W.T + bias`` for ``x`` ``[rows, in]`` (float32, on CPU), then ``relu`` or plus
    ``residual`` ``[rows, out]``, then, with ``norm`` (weight, bias, eps), a layer norm of each
    row, as one call."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("native products are unavailable")
    out = weight.out_features
    normed = () if norm is None else (norm[0].contiguous(), norm[1].contiguous())
    x, bias, residual = native_library.operands(x, out, bias, residual, *normed)
    rows, inner = x.shape
    if weight.values.size(1) != inner:
        raise ValueError(f"input has {inner} features, the weight takes {weight.values.size(1)}")
    y = x.new_empty((rows, out))  # a tensor subclass of x carries over, as through torch ops
    kernel(
        x.data_ptr(),
        x.stride(0),
        weight.values.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        y.data_ptr(),
        out,
        rows,
        out,
        inner,
        int(relu),
        normed[0].data_ptr() if normed else None,
        normed[1].data_ptr() if normed else None,
        0.0 if norm is None else norm[2],
        threads_for(rows * out * inner),
    )
    return y

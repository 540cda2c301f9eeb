"""bfloat16 matrix products (``--bf16``) on the CPU through our kernel
(``native/bf16_products.c``), on CPUs with AVX512-BF16.

bfloat16 products went through oneDNN's matmul, whose ~12 us a call made ``--bf16`` slower
than our float32 kernel at batch 1 (x0.84 on the demo convs2s). This kernel sums pairs of
bfloat16 products into float32 (vdpbf16ps), adds bias, relu or residual in float32 and rounds
once to bfloat16, as oneDNN's matmul with its post-ops does; each element summed in a fixed
order, so a row's bits do not depend on its batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import native_library
from beamplugin.kernels.native_library import INT, POINTER, SIZE, threads_for

PANEL = 32  # output channels a panel holds (bf16_products.c's NR)


class BF16Panels(NamedTuple):
    """A bfloat16 weight ``[out, in]`` packed for :func:`product`: ``[ceil(out / 32), ceil(in /
    2), 32, 2]``."""

    values: Tensor
    out_features: int
    in_features: int


@functools.cache
def _kernel() -> Callable[..., Any] | None:
    """bf16_products.c's ``bf16_products`` (None where it cannot be built or the CPU has no
    AVX512-BF16)."""
    native = native_library.function("bf16_products", "bf16_kernel_available", [], INT)
    if native is None or not native():
        return None
    signature = [POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE]
    return native_library.function("bf16_products", "bf16_products", [*signature, INT, INT])


def available() -> bool:
    return _kernel() is not None


def pack(weight: Tensor) -> BF16Panels:
    """A bfloat16 ``weight`` ``[out, in]`` laid out for :func:`product`."""
    out_features, in_features = weight.shape
    panels, pairs = -(-out_features // PANEL), -(-in_features // 2)
    padded = weight.new_zeros(panels * PANEL, pairs * 2)
    padded[:out_features, :in_features] = weight
    laid = padded.view(panels, PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return BF16Panels(laid, out_features, in_features)


def product(
    x: Tensor,
    weight: BF16Panels,
    bias: Tensor | None,
    residual: Tensor | None = None,
    relu: bool = False,
) -> Tensor:
    """``x @ W.T + bias`` for bfloat16 ``x`` ``[rows, in]`` on the CPU, then ``relu`` or plus
    ``residual`` ``[rows, out]``, rounded once to bfloat16."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("native bfloat16 products are unavailable")
    out = weight.out_features
    x, bias, residual = native_library.operands(x, out, bias, residual, dtype=torch.bfloat16)
    rows, inner = x.shape
    if inner != weight.in_features:
        raise ValueError(f"input has {inner} features, the weight takes {weight.in_features}")
    y = x.new_empty((rows, out))
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
        threads_for(rows * out * inner),
    )
    return y

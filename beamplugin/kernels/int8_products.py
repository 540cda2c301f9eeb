"""int8 matrix products (``--int8``) on the CPU through our kernel (``native/int8_products.c``),
on CPUs with AVX512-VNNI or AVX2 (each its own code, the same bits).

beamplugin.modules.int8_weights.int8_linear takes some ten torch operations a product (the row
scales, the quantization, ``torch._int_mm``, the scaling back), each a call of several microseconds
at a decoder step's few rows, so that with our float32 kernel ``--int8`` gained nothing at batch 1.
This kernel quantizes the rows and multiplies in one call, with int8_linear's roundings: the same
bits (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import layouts, native_library
from beamplugin.kernels.native_library import FLOAT, INT, POINTER, SIZE, threads_for

PANEL = 32  # output channels a panel holds (int8_products.c's NR)
# A row's scale is at least this, so that dividing by it stays finite (a zero row quantizes to
# zeros, not to NaN).
SMALLEST_SCALE = 1e-30
GROUP = 4  # inner positions a vpdpbusd lane sums


class Int8Panels(NamedTuple):
    """int8 weight values ``[out, in]`` packed for :func:`product`: ``[ceil(out / 32), ceil(in /
    4), 32, 4]``, and each output channel's values summed (int32)."""

    values: Tensor
    sums: Tensor
    out_features: int
    in_features: int


@native_library.cached
def _kernel() -> Callable[..., Any] | None:
    """int8_products.c's ``int8_products`` (None where it cannot be built, or the set has no
    int8 code: generic, NEON)."""
    signature = [POINTER, SIZE, SIZE, FLOAT, POINTER, POINTER, POINTER, POINTER, POINTER, SIZE]
    signature += [POINTER, SIZE, SIZE, SIZE, INT, INT]
    return native_library.function_for_this_cpu(
        "int8_products", "int8_kernel_available", "int8_products", signature, INT
    )


def available() -> bool:
    return _kernel() is not None


def pack(values: Tensor) -> Int8Panels:
    """int8 ``values`` ``[out, in]`` laid out for :func:`product`."""
    laid = layouts.panels(values, GROUP, PANEL)
    sums = values.new_empty(values.size(0), dtype=torch.int32)
    # summed a few MB of rows at a time: torch widens what it sums to int32 first
    step = max(1, (8 << 20) // (4 * max(1, values.size(1))))
    for first in range(0, values.size(0), step):
        sums[first : first + step] = values[first : first + step].sum(1, dtype=torch.int32)
    return Int8Panels(laid, sums, *values.shape)


def columns(weight: Int8Panels, channels: Tensor) -> Int8Panels:
    """The output ``channels`` of ``weight`` alone, packed alike (the same values and sums)."""
    values = layouts.panel_columns(weight.values, channels)
    return Int8Panels(values, weight.sums[channels], channels.numel(), weight.in_features)


def product(
    x: Tensor,
    weight: Int8Panels,
    channel_scales: Tensor,
    bias: Tensor | None,
    smallest_scale: float,
    residual: Tensor | None = None,
    relu: bool = False,
) -> Tensor:
    """int8_linear of ``x`` ``[rows, in]`` (float32, CPU): each row quantized with its own scale
    (max |x| / 127, at least ``smallest_scale``), multiplied by the packed weight, scaled back by
    ``channel_scales`` and the row's scale, plus ``bias``; then ``relu`` or plus ``residual``."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("native int8 products are unavailable")
    out = weight.out_features
    x, bias, residual = layouts.operands(x, out, bias, residual, channel_scales)
    rows, inner = x.shape
    if inner != weight.in_features:
        raise ValueError(f"input has {inner} features, the weight takes {weight.in_features}")
    y = x.new_empty((rows, out))
    failed = kernel(
        x.data_ptr(),
        x.stride(0),
        inner,
        smallest_scale,
        weight.values.data_ptr(),
        weight.sums.data_ptr(),
        channel_scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        y.data_ptr(),
        out,
        rows,
        out,
        int(relu),
        threads_for(rows * out * inner),
    )
    if failed:
        raise MemoryError(f"no memory to quantize {rows} rows")
    return y

"""Float32 and bfloat16 matrix products on the CPU through our own kernels
(``native/products.c``; ``native/bf16_products.c`` on CPUs with AVX512-BF16).

At a decoder step's few rows torch's products cost mostly their call: oneDNN's matmul takes
about 12 us for any product, even 16 x 16, so a 3-layer transformer's 19 products a step spend
some 0.2 ms in calls alone (MKL and OpenBLAS have less overhead but run 2-4 times slower here).
These kernels are called through ctypes in about 1 us, read each weight once from panels laid
out for them, and are as fast as oneDNN from about 40 rows (docs/speed.md). Each output element
is summed in order over the inner dimension, so a row's result has the same bits whatever rows
are beside it and whatever the number of threads. bfloat16 products sum pairs into float32 and
round once, as oneDNN's matmul with its post-ops does.

``--bf16`` keeps a float32 model and packs its weights in bfloat16 (:class:`Bf16Weights`): each
product rounds its float32 rows to bfloat16 once and sums into float32 (no rounding of the
result), so norms, attention and the residual stream stay float32 and every float32 path of
ours (a transformer's step in one call, ConvS2S's convolutions) runs as it is, reading half the
weight bytes with twice the multiply-adds an instruction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import layouts, native_library
from beamplugin.kernels.native_library import FLOAT, INT, POINTER, SIZE, threads_for

# x, its row stride, the panels, bias, residual, its row stride, y, its row stride, rows, out,
# in, relu: the arguments both kernels begin with
_PRODUCT = [POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, INT]
# the inner positions each kernel reads side by side (vdpbf16ps multiplies bfloat16 pairs)
_GROUP = {torch.float32: 1, torch.bfloat16: 2}


class Panels(NamedTuple):
    """A float32 or bfloat16 weight ``[out, in]`` packed for :func:`product`
    (:func:`beamplugin.kernels.layouts.panels`)."""

    values: Tensor
    out_features: int
    in_features: int


@native_library.cached
def _kernel() -> Callable[..., Any] | None:
    """products.c's ``products`` (float32, a layer norm after it optional), loaded once a process
    (None where it cannot be built)."""
    signature = [*_PRODUCT, POINTER, POINTER, FLOAT, INT]  # + the norm's weight, bias, eps
    return native_library.function("products", "products", signature)


class Bf16Weights(Panels):
    """A float32 weight packed in bfloat16 panels for float32 activations
    (:func:`pack_bf16_weights`): :func:`product` rounds the rows to bfloat16 and returns float32
    sums."""


@native_library.cached
def _bf16_weight_kernel() -> Callable[..., Any] | None:
    """bf16_products.c's ``bf16_weight_products`` (None where it cannot be built or the CPU has
    no AVX512-BF16)."""
    return native_library.function_for_this_cpu(
        "bf16_products", "bf16_kernel_available", "bf16_weight_products", [*_PRODUCT, INT], INT
    )


def bf16_weights_available() -> bool:
    """Whether float32 activations multiply bfloat16 weights on our kernel here
    (:class:`Bf16Weights`)."""
    return _bf16_weight_kernel() is not None


def pack_bf16_weights(weight: Tensor) -> Bf16Weights:
    """``weight`` (``[out, in]``, any float dtype) rounded to bfloat16 (to nearest even) and laid
    out for :func:`product` of float32 rows."""
    values = layouts.panels(weight.detach().to(torch.bfloat16), _GROUP[torch.bfloat16])
    return Bf16Weights(values, *weight.shape)


@native_library.cached
def _bf16_kernel() -> Callable[..., Any] | None:
    """bf16_products.c's ``bf16_products`` (None where it cannot be built or the CPU has no
    AVX512-BF16)."""
    return native_library.function_for_this_cpu(
        "bf16_products", "bf16_kernel_available", "bf16_products", [*_PRODUCT, INT]
    )


def _kernel_for(dtype: torch.dtype) -> Callable[..., Any] | None:
    if dtype == torch.float32:
        return _kernel()
    return _bf16_kernel() if dtype == torch.bfloat16 else None


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether products of ``dtype`` run on our kernel here (built and loaded: see
    beamplugin.kernels.native_library)."""
    return _kernel_for(dtype) is not None


def pack(weight: Tensor) -> Panels:
    """``weight`` (float32 or bfloat16, ``[out, in]``) laid out in panels for :func:`product`."""
    values = layouts.panels(weight, _GROUP[weight.dtype])
    return Panels(values, *weight.shape)


def columns(weight: Panels, channels: Tensor) -> Panels:
    """The output ``channels`` of ``weight`` alone, packed alike (each one's products the same
    bits)."""
    values = layouts.panel_columns(weight.values, channels)
    return type(weight)(values, channels.numel(), weight.in_features)


def product(
    x: Tensor,
    weight: Panels,
    bias: Tensor | None,
    residual: Tensor | None = None,
    relu: bool = False,
    norm: tuple[Tensor, Tensor, float] | None = None,
) -> Tensor:
    """``x @ W.T + bias`` for ``x`` ``[rows, in]`` (the weight's dtype, on the CPU; float32 for
    :class:`Bf16Weights`), then ``relu`` or plus ``residual`` ``[rows, out]``, then, with
    ``norm`` (weight, bias, eps; float32 only), a layer norm of each row, as one call."""
    if isinstance(weight, Bf16Weights):
        return _bf16_weight_product(x, weight, bias, residual, relu, norm)
    dtype = weight.values.dtype
    kernel = _kernel_for(dtype)
    if kernel is None:
        raise RuntimeError(f"native {dtype} products are unavailable")
    if norm is not None and dtype != torch.float32:
        raise ValueError("only float32 products layer-norm in their call")
    out = weight.out_features
    normed = () if norm is None else (norm[0].contiguous(), norm[1].contiguous())
    x, bias, residual = layouts.operands(x, out, bias, residual, *normed, dtype=dtype)
    rows, inner = x.shape
    if inner != weight.in_features:
        raise ValueError(f"input has {inner} features, the weight takes {weight.in_features}")
    y = x.new_empty((rows, out))  # a tensor subclass of x carries over, as through torch ops
    arguments = [
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
    ]
    if dtype == torch.float32:
        arguments += [
            normed[0].data_ptr() if normed else None,
            normed[1].data_ptr() if normed else None,
            0.0 if norm is None else norm[2],
        ]
    kernel(*arguments, threads_for(rows * out * inner))
    return y


def _bf16_weight_product(
    x: Tensor,
    weight: Bf16Weights,
    bias: Tensor | None,
    residual: Tensor | None,
    relu: bool,
    norm: tuple[Tensor, Tensor, float] | None,
) -> Tensor:
    """:func:`product` of float32 ``x`` on bfloat16 weights; the norm after the product's call
    (the norm kernel's bits, as transformer_layers.c's int8 and bfloat16 products take it)."""
    kernel = _bf16_weight_kernel()
    if kernel is None:
        raise RuntimeError("native bfloat16 products are unavailable")
    out = weight.out_features
    x, bias, residual = layouts.operands(x, out, bias, residual)
    rows, inner = x.shape
    if inner != weight.in_features:
        raise ValueError(f"input has {inner} features, the weight takes {weight.in_features}")
    y = x.new_empty((rows, out))
    failed = kernel(
        x.data_ptr(), x.stride(0), weight.values.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        y.data_ptr(), out, rows, out, inner, int(relu), threads_for(rows * out * inner),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory to round {rows} rows to bfloat16")
    if norm is None:
        return y
    normed = layer_norm(y, norm[0].contiguous(), norm[1].contiguous(), norm[2])
    if normed is None:
        raise RuntimeError("native layer norm unavailable")
    return normed


@native_library.cached
def _norm_kernel() -> Callable[..., Any] | None:
    """products.c's ``layer_norm_rows`` (None where it cannot be built)."""
    signature = [POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, POINTER, POINTER, FLOAT, INT]
    return native_library.function("products", "layer_norm_rows", signature)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor | None:
    """Each row of ``x`` ``[rows, n]`` (float32, CPU) layer-normed as the product kernels'
    post-norm (the same bits), or None where the kernel is not here."""
    kernel = _norm_kernel()
    if kernel is None or x.dtype is not torch.float32 or not x.is_cpu:
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    rows, n = x.shape
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"the norm's weight and bias must be [{n}]")
    if not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()
    y = torch.empty_like(x)
    kernel(x.data_ptr(), n, y.data_ptr(), n, rows, n, weight.data_ptr(), bias.data_ptr(), eps,
           threads_for(rows * n * 64))  # fmt: skip
    return y

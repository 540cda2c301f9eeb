"""Int8 products (``--int8``): which weights take them, their quantization per output channel,
their packing for our int8 kernel (where it is faster than torch's int8 path at a weight's
shape), and the product itself, whose result for a row depends on that row alone."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import int8_products, native_library, trials
from beamplugin.kernels.int8_products import Int8Panels
from beamplugin.kernels.trials import TRIAL_ROWS, Trial

# With int8 products on (--int8), weights of at least this many elements: every product of
# iwslt's shapes, the 256 x 256 attention projections included (with every float32 product on
# oneDNN, int8 for those made the decode x1.24 of float32 at batch 1 and x1.58 at batch 64,
# against x1.06-1.11 and x1.40-1.43 with them in float32: docs/speed.md); smaller ones, where
# the quantization's own operations cost more than the product, stay float32.
INT8_MIN_WEIGHTS = 1 << 16


def large_for_int8(weight: Tensor) -> bool:
    """Whether ``weight`` is multiplied in int8 where int8 products are on (:data:`INT8_MIN_WEIGHTS`
    elements or more)."""
    return weight.numel() >= INT8_MIN_WEIGHTS


@functools.cache
def torchs_int8_is_exact(weight_levels: int) -> bool:
    """Whether torch's int8 product (``torch._int_mm``: oneDNN's s8s8s32 gemm) sums exactly
    for activations up to +-127 and weights up to +-``weight_levels``, at the layouts and row
    counts :func:`int8_linear` uses. CPUs with VNNI (AVX512-VNNI, AVX-VNNI) or AMX sum 8-bit
    products in 32 bits; without them (AVX2, AVX512 alone) oneDNN adds pairs of products in 16
    bits with saturation, exact only for 7-bit weights."""
    k = 256
    for rows in (1, 5, 64):
        for x_sign, w_sign in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
            x = torch.full((rows, k), 127 * x_sign, dtype=torch.int8)
            w = torch.full((16, k), weight_levels * w_sign, dtype=torch.int8)
            expected = 127 * weight_levels * k * x_sign * w_sign
            if not bool(torch._int_mm(x, w.t()).eq(expected).all()):
                return False
    return True


@native_library.cached
def int8_weight_levels() -> int:
    """The largest int8 weight magnitude whose products are summed exactly here: 127 where our
    int8 kernel runs (exact on every instruction set it has) or torch's sums 8-bit weights
    exactly (VNNI, AMX), else 63 (7-bit weights; activations keep 8 bits). torch's probed once,
    on the kernel it really runs (``ONEDNN_MAX_CPU_ISA`` may cap what the flags promise)."""
    return 127 if int8_products.available() or torchs_int8_is_exact(127) else 63


class Int8Weight(NamedTuple):
    """A weight for :func:`int8_linear`: int8 values (out x in), float32 scale per output
    channel (out), the float32 bias (or None), and the values packed for our int8 kernel where
    this CPU runs it (beamplugin.kernels.int8_products); then the plain values are not kept
    (None): only that kernel reads them."""

    values: Tensor | None
    scales: Tensor
    bias: Tensor | None
    panels: Int8Panels | None = None
def pack_int8(
    weight: Tensor, bias: Tensor | None, read: Callable[[Tensor], object] | None = None
) -> Int8Weight:
    """``weight`` quantized (:func:`quantize_int8`), in our kernel's panels where it runs (the
    plain values then dropped), else as plain values for torch's int8 path."""
    int8 = quantize_int8(weight, bias, read)
    # torch's path only where it sums these weights exactly (then the same bits as ours)
    if int8_products.available() and (
        not torchs_int8_is_exact(int8_weight_levels())
        or trials.ours_is_faster(
            "int8_products", tuple(int8.values.shape), lambda: _int8_trial(int8)
        )
    ):
        int8 = in_panels(int8)
    return int8


def in_panels(plain: Int8Weight) -> Int8Weight:
    """A :func:`quantize_int8` weight's values packed for our int8 kernel, the plain ones not
    kept."""
    return plain._replace(values=None, panels=int8_products.pack(plain.values))


def quantize_int8(
    weight: Tensor, bias: Tensor | None, read: Callable[[Tensor], object] | None = None
) -> Int8Weight:
    """``weight`` quantized to int8 per output channel, symmetric: scale max |w| /
    :func:`int8_weight_levels`, values rounded to the nearest integer (torch's int8 path's
    weight). ``read``, if given, is called with each block of ``weight``'s rows once quantized
    (to hand its pages back)."""
    levels = int8_weight_levels()
    w = weight.detach().float()
    scales = w.new_empty(w.size(0))
    values = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    # a few MB of rows at a time: no float32 temporaries the size of a 1 GB output projection
    step = max(1, (8 << 20) // (4 * max(1, w.size(1))))
    for first in range(0, w.size(0), step):
        rows = w[first : first + step]
        scale = (rows.abs().amax(1) / levels).clamp_(min=torch.finfo(torch.float32).tiny)
        scales[first : first + step] = scale
        values[first : first + step] = torch.round(rows / scale[:, None])
        if read is not None:
            read(rows)
    bias = None if bias is None else bias.detach().float()
    return Int8Weight(values, scales, bias)


def _int8_trial(torchs: Int8Weight) -> Trial:
    """Our int8 kernel against torch's int8 path at a weight's shape (the same bits)."""
    ours = in_panels(torchs)
    inputs = [(torch.randn(rows, torchs.values.size(1)),) for rows in TRIAL_ROWS]
    return Trial(lambda x: int8_linear(x, ours), lambda x: int8_linear(x, torchs), inputs)


def int8_linear(
    x: Tensor, weight: Int8Weight, relu: bool = False, residual: Tensor | None = None
) -> Tensor:
    """``F.linear`` with a :func:`pack_int8` weight: each row of ``x`` is quantized to int8 with
    its own scale (max |x_row| / 127), multiplied in int8 with 32-bit sums, and scaled back to
    float32.

    A row's result depends on that row alone, whatever rows share the product: the quantization
    is per row, integer sums are exact in any order and blocking, and the scaling back is one
    rounding per operation, element by element. So a sentence decodes the same alone or with
    any batch-mates, as in float32 (a shared scale, as torch's dynamic quantized linear takes,
    would tie every row to the largest activation of the step). Then ``relu``, or plus
    ``residual`` (``[rows, out]``). Where the weight has our kernel's panels and ``x`` is on the
    CPU, our kernel computes it, with the same roundings (the same bits)."""
    if weight.panels is not None:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            raise ValueError(f"int8 products take float32 inputs on the CPU, not {x.dtype} "
                             f"on {x.device}")  # fmt: skip
        rows = x.reshape(-1, x.size(-1))
        other = None if residual is None else residual.reshape(rows.size(0), -1)
        smallest = int8_products.SMALLEST_SCALE
        out = int8_products.product(
            rows, weight.panels, weight.scales, weight.bias, smallest, other, relu
        )
        return out.view(*x.shape[:-1], weight.scales.size(0))
    rows = x.reshape(-1, x.size(-1))
    scale = rows.abs().amax(1, keepdim=True).div_(127).clamp_(min=int8_products.SMALLEST_SCALE)
    quantized = torch.div(rows, scale).round_().to(torch.int8)
    # converted first: torch's mixed int32 x float32 multiply is far slower (docs/precision.md)
    out = torch._int_mm(quantized, weight.values.t()).float()
    out.mul_(weight.scales).mul_(scale)
    if weight.bias is not None:
        out.add_(weight.bias)
    if relu:
        out.relu_()
    if residual is not None:
        out.add_(residual.reshape(out.shape))
    return out.view(*x.shape[:-1], weight.scales.size(0))

"""How our product kernels read tensors: the operands of a product checked and made
contiguous (:func:`operands`), and a weight laid out in panels (:func:`panels`,
:func:`panel_columns`). Layouts only, apart from building and loading the kernels
(beamplugin.kernels.native_library)."""

from __future__ import annotations

import torch
from torch import Tensor


def operands(
    x: Tensor,
    out: int,
    bias: Tensor | None,
    residual: Tensor | None,
    *vectors: Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A product's operands as a kernel reads them through raw pointers: ``x`` ``[rows, in]``
    and ``residual`` ``[rows, out]`` with contiguous rows, ``bias`` and ``vectors`` ``out``
    contiguous elements, ``dtype`` on the CPU (``x`` checked: the others come from the same
    model); a ValueError for anything else, as a kernel would read past them. Straight-line
    checks: this runs at every product of a decoder step."""
    if x.dtype is not dtype or not x.is_cpu or x.dim() != 2:
        raise ValueError(f"this kernel takes 2-D {dtype} CPU inputs, not {x.dtype} {x.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        if bias.numel() != out:
            raise ValueError(f"biases, scales and norm weights must have {out} elements")
        if not bias.is_contiguous():
            bias = bias.contiguous()
    if residual is not None:
        if residual.shape != (x.size(0), out):
            raise ValueError(f"the residual is {tuple(residual.shape)}, not {(x.size(0), out)}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    for vector in vectors:
        if vector.numel() != out or not vector.is_contiguous():
            raise ValueError(f"biases, scales and norm weights must have {out} contiguous elements")
    return x, bias, residual


# the rows made into panels at once (:func:`panels`)
_PANEL_BLOCK_BYTES = 8 << 20


def panels(weight: Tensor, group: int, panel: int = 32) -> Tensor:
    """``weight`` ``[out, in]`` laid out as our product kernels read it: ``[ceil(out / panel),
    ceil(in / group), panel, group]``, ``group`` consecutive inner positions of a channel side by
    side (1 for float32, 2 for bfloat16 pairs, 4 for int8 quadruples), zeros past its end. Made
    a few panels at a time: no whole-size copy beside the result (a 1 GB output projection)."""
    out_features, in_features = weight.shape
    count, groups = -(-out_features // panel), -(-in_features // group)
    laid_out = weight.new_zeros(count, groups, panel, group)
    step = max(1, _PANEL_BLOCK_BYTES // max(1, panel * groups * group * weight.element_size()))
    for first in range(0, count, step):
        rows = weight[first * panel : (first + step) * panel]
        block = -(-rows.size(0) // panel)
        padded = weight.new_zeros(block * panel, groups * group)
        padded[: rows.size(0), :in_features] = rows
        laid_out[first : first + block] = padded.view(block, panel, groups, group).transpose(1, 2)
    return laid_out


def panel_columns(laid_out: Tensor, columns: Tensor) -> Tensor:
    """The output channels ``columns`` of a weight laid out by :func:`panels` (``[count, groups,
    panel, group]``), laid out alike: the same values, read from the panels (a weight whose
    pages went back to its file is not read again)."""
    _, groups, panel, group = laid_out.shape
    picked = laid_out[columns // panel, :, columns % panel]  # [n, groups, group]
    count = -(-columns.numel() // panel)
    padded = laid_out.new_zeros(count * panel, groups, group)
    padded[: columns.numel()] = picked
    return padded.view(count, panel, groups, group).transpose(1, 2).contiguous()

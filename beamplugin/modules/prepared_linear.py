"""A product's weight made ready once for inference (:class:`PreparedLinear`): packed, or in
int8, or plain where neither applies; and the product of a few of its output channels alone,
with the bits each gets in the whole product."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from beamplugin.kernels import float_products, int8_products
from beamplugin.kernels.float_products import Bf16Weights, Panels
from beamplugin.modules.int8_weights import Int8Weight, int8_linear, large_for_int8, pack_int8
from beamplugin.modules.packed_weights import (
    PackedWeight,
    normed,
    onednn_layout,
    pack_weight,
    packed_dtypes,
    packed_product,
    packs_bf16_weights,
)
from beamplugin.modules.plain_linear import plain_linear


def _normed_as_kernels(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
    """``x`` normed as our kernels' post-norm does it (an int8 layer's in a transformer step
    in one call: the same bits), torch's norm where that kernel is not here."""
    if norm is not None and norm.weight is not None and norm.bias is not None:
        ours = float_products.layer_norm(x, norm.weight, norm.bias, norm.eps)
        if ours is not None:
            return ours
    return normed(x, norm)


class PreparedLinear(NamedTuple):
    """A product's weight made ready once for inference (:func:`prepare_linear`): the plain
    weight (None where only our kernels multiply it: see ``keep_weight``) and bias, its
    :func:`pack_weight` whatever its size, or int8 values where int8 products are on for a
    weight this large. Inputs are 2-D, ``[rows, in]``.

    On the packed weight each row's result has the same bits whatever the number of rows
    (MKL's ``F.linear`` takes other kernels for 1 to 3 rows), so a sentence decodes the same
    alone or batched."""

    weight: Tensor | None
    bias: Tensor | None
    packed: PackedWeight | None
    int8: Int8Weight | None

    def __call__(self, x: Tensor) -> Tensor:
        if self._on_packed(x):
            return packed_product(x, self.packed, self.bias)
        return self._unfused(x)

    def relu(self, x: Tensor) -> Tensor:
        """``relu(self(x))``, the relu in the product's call (same bits)."""
        if self._on_packed(x):
            return packed_product(x, self.packed, self.bias, relu=True)
        if self.int8 is not None:
            return int8_linear(x, self.int8, relu=True)
        return self._unfused(x).relu_()

    def plus(self, x: Tensor, other: Tensor, norm: nn.LayerNorm | None = None) -> Tensor:
        """``self(x) + other`` (a residual), the sum in the product's call (same bits); then
        ``norm`` (a post-norm layer's), in that call too on our float32 kernel."""
        if self._on_packed(x):
            return packed_product(x, self.packed, self.bias, residual=other, norm=norm)
        if self.int8 is not None:
            return _normed_as_kernels(int8_linear(x, self.int8, residual=other), norm)
        return normed(self._unfused(x).add_(other), norm)

    def on_our_kernels(self) -> bool:
        """Whether our float32, bfloat16-weight or int8 kernel multiplies this weight, on
        float32 rows (packed in its panels)."""
        if self.int8 is not None:
            return self.int8.panels is not None
        packed = self.packed
        return isinstance(packed, Bf16Weights) or (
            isinstance(packed, Panels) and packed.values.dtype == torch.float32
        )

    def _on_packed(self, x: Tensor) -> bool:
        """Whether ``x`` (2-D) goes through the packed weight (no int8, the dtype it multiplies,
        inference)."""
        if self.packed is None or self.int8 is not None or torch.is_grad_enabled():
            return False
        if isinstance(self.packed, Bf16Weights):
            return x.dtype == torch.float32
        values = self.packed.values if isinstance(self.packed, Panels) else self.packed
        return x.dtype == values.dtype

    def _unfused(self, x: Tensor) -> Tensor:
        if self.int8 is not None:
            return int8_linear(x, self.int8)
        if self.weight is None:
            raise ValueError("this product was prepared for our kernels' inference only, not for "
                             f"{x.dtype} inputs or autograd")  # fmt: skip
        return plain_linear(x, self.weight, self.bias)


def prepare_linear(
    weight: Tensor,
    bias: Tensor | None,
    int8: bool = False,
    keep_weight: bool = True,
    read: Callable[[Tensor], object] | None = None,
    bf16: bool = False,
) -> PreparedLinear:
    """``weight`` and ``bias`` (detached) ready for products without autograd; with ``int8``,
    a weight :func:`large_for_int8` is multiplied in int8 (``read`` as
    :func:`pack_int8`'s); with ``bf16`` (``--bf16``), a weight :func:`packs_bf16_weights`
    takes is packed in bfloat16 for float32 rows. Without ``keep_weight`` the plain weight is
    not kept where our kernels multiply it (a copy made for them, as stacked projections are)."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if int8 and large_for_int8(weight):
        prepared = PreparedLinear(weight, bias, None, pack_int8(weight, bias, read))
    elif bf16 and packs_bf16_weights(weight):
        prepared = PreparedLinear(weight, bias, float_products.pack_bf16_weights(weight), None)
    else:
        on_packed = weight.device.type == "cpu" and weight.dtype in packed_dtypes()
        prepared = PreparedLinear(weight, bias, pack_weight(weight) if on_packed else None, None)
    if keep_weight or not prepared.on_our_kernels():
        return prepared
    return prepared._replace(weight=None)


def columns_of(prepared: PreparedLinear, weight: Tensor, columns: Tensor) -> PreparedLinear:
    """The product of output channels ``columns`` alone, on the kind of kernel ``prepared``
    takes: each channel gets the bits it gets in the whole product (int8 values and scales are
    per channel; a float32 channel's sum runs in the same order in any panel). Our kernels'
    panels give their own channels; torch's paths take rows of ``weight``, the plain weight
    ``prepared`` was made from."""
    bias = None if prepared.bias is None else prepared.bias.index_select(0, columns)
    int8 = prepared.int8
    if int8 is not None:
        scales = int8.scales.index_select(0, columns)
        if int8.panels is not None:
            picked = int8_products.columns(int8.panels, columns)
            return PreparedLinear(None, bias, None, Int8Weight(None, scales, bias, picked))
        return PreparedLinear(None, bias, None, Int8Weight(int8.values[columns], scales, bias))
    packed = prepared.packed
    if isinstance(packed, Panels):
        return PreparedLinear(None, bias, float_products.columns(packed, columns), None)
    rows = weight.detach().index_select(0, columns)
    return PreparedLinear(rows, bias, None if packed is None else onednn_layout(rows), None)


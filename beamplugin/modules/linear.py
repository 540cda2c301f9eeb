"""Matrix products of the model in inference, on packed weights, on CPU: float32 through our
own kernel (beamplugin.kernels.float_products), half precisions through oneDNN's matmul.

On CPU, ``F.linear`` runs float32 products through MKL, which on the AMD EPYC we measured is
1.6-2.4 times slower than oneDNN's matmul from 5 rows up, at every shape of these models
(``python -m benchmarks.linear``; docs/speed.md), and picks other kernels for 1 to 3 rows, so
a row's result would depend on how many rows share its product. oneDNN's matmul in turn costs
about 12 us a call whatever its size, most of a decoder step's product at a few rows; our
kernel is called in about 1 us and is as fast as oneDNN from about 40 rows. Both give a row the
same bits whatever rows are beside it, which makes a sentence decode bit for bit the same alone
or batched, and differ from ``F.linear`` only in rounding (about 1e-6 relative). Where our kernel
cannot be built (no C compiler), float32 takes oneDNN's matmul too. Training keeps
``F.linear``: neither has an autograd formula.

Given a plain weight, oneDNN lays it out in its blocked format on every product: a read and a
write of the whole weight on top of the product's own read. Modules keep a packed copy instead
(:class:`InferenceCache`): faster when the weight comes from memory rather than cache, as it
does between decoder steps. A model cast to bfloat16 or float16 packs its weights in that
precision, on CPUs that multiply it in hardware (beamplugin.fairseq_plugin.precision).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.kernels import float_products, int8_products, native_library, trials
from beamplugin.kernels.float_products import Panels
from beamplugin.kernels.int8_products import Int8Panels
from beamplugin.kernels.trials import Trial


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices in hardware (oneDNN's own test: AVX512-BF16
    or AMX for bfloat16, AVX512-FP16 or AVX-NE-CONVERT for float16); without it torch converts
    every element and its half-precision products are slower than float32."""
    if dtype == torch.float32:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


_onednn_linear = (
    torch.ops.mkldnn._linear_pointwise
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    else None
)
_onednn_linear_binary = _onednn_linear.binary if _onednn_linear is not None else None
_onednn_pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _onednn_linear else None
# Half-precision weights only where the CPU multiplies them in hardware: elsewhere oneDNN cannot
# pack them (and torch's emulated products are slower than float32: docs/precision.md).
ONEDNN_DTYPES = frozenset(
    dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    if _onednn_linear is not None and native_on_cpu(dtype)
)


# With int8 products on (--int8), weights of at least this many elements: every product of
# iwslt's shapes, the 256 x 256 attention projections included (with every float32 product on
# oneDNN, int8 for those made the decode x1.24 of float32 at batch 1 and x1.58 at batch 64,
# against x1.06-1.11 and x1.40-1.43 with them in float32: docs/speed.md); smaller ones, where
# the quantization's own operations cost more than the product, stay float32.
INT8_MIN_WEIGHTS = 1 << 16
# The rows our product kernels are timed at against torch's for a weight's shape
# (beamplugin.kernels.trials): a decoder step's at beam 5, and a batch's of 16 sentences.
TRIAL_ROWS = (5, 80)


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


PackedWeight = Panels | Tensor  # our kernels' panels, or oneDNN's layout


@native_library.cached
def packed_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose products run on packed weights: float32 where our kernel is built (it
    is compiled on first use), and :data:`ONEDNN_DTYPES`."""
    ours = {d for d in (torch.float32, torch.bfloat16) if float_products.available(d)}
    return ONEDNN_DTYPES | ours


def uses_packed_products(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x @ weight.T`` runs on a packed weight: in inference, on CPU, float32 (our
    kernel, or oneDNN's without it) or a half precision this CPU multiplies (oneDNN's)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.dtype in packed_dtypes()
        and not torch.is_grad_enabled()
    )


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    packed: Callable[[], PackedWeight | None] | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)``, on a packed weight in inference on CPU (see module doc).
    ``packed``, if given, returns :func:`pack_weight` of ``weight``; it is only called on that
    path (a cache lookup or a packing that the other path does not need)."""
    if not uses_packed_products(x, weight):
        if x.is_cuda and x.dtype == torch.float32 and not torch.is_grad_enabled():
            return rows_in_chunks(x.reshape(-1, x.size(-1)), weight, bias).view(
                *x.shape[:-1], weight.size(0)
            )
        return F.linear(x, weight, bias)
    layout = packed() if packed is not None else pack_weight(weight)
    # oneDNN also takes a plain weight (and lays it out at each call)
    out = packed_product(x.reshape(-1, x.size(-1)), weight if layout is None else layout, bias)
    return out.view(*x.shape[:-1], weight.size(0))


def pack_weight(weight: Tensor) -> PackedWeight | None:
    """``weight`` laid out for :func:`packed_product`: our kernels' panels for float32 where
    they are built and for bfloat16 on AVX512-BF16 CPUs, and faster than torch's at this shape
    (beamplugin.kernels.trials), else oneDNN's layout (None where torch has no packing)."""
    weight = weight.detach()
    if float_products.available(weight.dtype) and trials.ours_is_faster(
        "products", (str(weight.dtype), *weight.shape), lambda: _products_trial(weight)
    ):
        return float_products.pack(weight)
    return _torchs_layout(weight)


def _torchs_layout(weight: Tensor) -> Tensor | None:
    if _onednn_pack is None or weight.dtype not in ONEDNN_DTYPES:
        return None
    return _onednn_pack(weight, None)


def _products_trial(weight: Tensor) -> Trial:
    """Our product kernel against torch's (oneDNN's on its packed weight, or ``F.linear``) at
    ``weight``'s shape."""
    ours = float_products.pack(weight)
    theirs = _torchs_layout(weight)
    inputs = [(torch.randn(rows, weight.size(1)).to(weight.dtype),) for rows in TRIAL_ROWS]

    def torchs(x: Tensor) -> Tensor:
        return F.linear(x, weight) if theirs is None else packed_product(x, theirs, None)

    return Trial(lambda x: float_products.product(x, ours, None), torchs, inputs)


def packed_product(
    x: Tensor,
    packed: PackedWeight,
    bias: Tensor | None,
    relu: bool = False,
    residual: Tensor | None = None,
    norm: nn.LayerNorm | None = None,
) -> Tensor:
    """``x @ W.T + bias`` (``x`` 2-D) on :func:`pack_weight`'s ``W``, then ``relu`` or plus
    ``residual``, in one call; then ``norm`` (in that call too on our kernel)."""
    if isinstance(packed, Panels):
        in_call = packed.values.dtype == torch.float32 and norm is not None
        if in_call and norm.weight is not None and norm.bias is not None:
            affine = (norm.weight, norm.bias, norm.eps)
            return float_products.product(x, packed, bias, residual, relu, affine)
        return _normed(float_products.product(x, packed, bias, residual, relu), norm)
    if residual is not None:
        return _normed(_onednn_linear_binary(x, residual, packed, bias, "add"), norm)
    return _normed(_onednn_linear(x, packed, bias, "relu" if relu else "none", [], ""), norm)


def _normed(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
    if norm is None:
        return x
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _normed_as_kernels(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
    """``x`` normed as our kernels' post-norm does it (an int8 layer's in a transformer step
    in one call: the same bits), torch's norm where that kernel is not here."""
    if norm is not None and norm.weight is not None and norm.bias is not None:
        normed = float_products.layer_norm(x, norm.weight, norm.bias, norm.eps)
        if normed is not None:
            return normed
    return _normed(x, norm)


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
        return _normed(self._unfused(x).add_(other), norm)

    def on_our_kernels(self) -> bool:
        """Whether our float32 or int8 kernel multiplies this weight (packed in its panels)."""
        if self.int8 is not None:
            return self.int8.panels is not None
        return isinstance(self.packed, Panels) and self.packed.values.dtype == torch.float32

    def _on_packed(self, x: Tensor) -> bool:
        """Whether ``x`` (2-D) goes through the packed weight (no int8, same dtype, inference)."""
        if self.packed is None or self.int8 is not None or torch.is_grad_enabled():
            return False
        values = self.packed.values if isinstance(self.packed, Panels) else self.packed
        return x.dtype == values.dtype

    def _unfused(self, x: Tensor) -> Tensor:
        if self.int8 is not None:
            return int8_linear(x, self.int8)
        if self.weight is None:
            raise ValueError("this product was prepared for our kernels' inference only, not for "
                             f"{x.dtype} inputs or autograd")  # fmt: skip
        if x.is_cuda and x.dtype == torch.float32 and not torch.is_grad_enabled():
            return rows_in_chunks(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


ROW_CHUNK = 64  # rows a float32 product takes on a GPU at once (see rows_in_chunks)


def rows_in_chunks(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` of ``x`` ``[rows, in]`` in products of exactly :data:`ROW_CHUNK` rows (the
    last padded with zeros), so that a row's result does not depend on how many rows share its
    product: cuBLAS picks its float32 algorithm by the row count, and measured on an H100 a
    row's bits changed between 5 and 640 rows (its fp16 and bf16 products did not; docs/speed.md,
    "The device engine")."""
    rows = x.size(0)
    padded = -(-rows // ROW_CHUNK) * ROW_CHUNK
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    parts = [F.linear(x[i : i + ROW_CHUNK], weight, bias) for i in range(0, padded, ROW_CHUNK)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:rows]


def prepare_linear(
    weight: Tensor,
    bias: Tensor | None,
    int8: bool = False,
    keep_weight: bool = True,
    read: Callable[[Tensor], object] | None = None,
) -> PreparedLinear:
    """``weight`` and ``bias`` (detached) ready for products without autograd; with ``int8``,
    a weight of at least ``INT8_MIN_WEIGHTS`` elements is multiplied in int8 (``read`` as
    :func:`pack_int8`'s). Without ``keep_weight`` the plain weight is not kept where our
    kernels multiply it (a copy made for them, as stacked projections are)."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if int8 and weight.numel() >= INT8_MIN_WEIGHTS:
        prepared = PreparedLinear(weight, bias, None, pack_int8(weight, bias, read))
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
    return PreparedLinear(rows, bias, None if packed is None else _torchs_layout(rows), None)


class InferenceCache(nn.Module):
    """Keeps tensors derived from a module's parameters for inference (a folded, re-laid-out or
    packed weight) while those parameters are unchanged.

    Entries are keyed by the version counters and storage of the module's own parameters, so a
    state dict load or
    a torch optimizer step renews them; fairseq's optimizers write through ``p.data``, which
    bumps nothing, but run between ``train()`` and ``eval()``, which both drop the cache, as do
    moves and casts (``_apply``). Copies and pickles leave it out (packed oneDNN tensors cannot
    be copied).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the module's own arguments (nn.Linear's)
        self._cache: dict[str, Tensor | None] = {}
        self._cache_key: tuple[tuple[int, int], ...] | None = None
        self.int8_products = False  # set by beamplugin.fairseq_plugin.precision.cast_for_decoding

    def cached(self, name: str, make: Callable[[], Tensor | None]) -> Any:
        """``make()``, computed once while the module's parameters are unchanged."""
        # _parameters, not parameters(): this runs for every product of every decoder step
        key = tuple((p._version, p.data_ptr()) for p in self._parameters.values() if p is not None)
        if key != self._cache_key:
            self._cache, self._cache_key = {}, key
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    def multiplies_in_int8(self, weight: Tensor) -> bool:
        """Whether :meth:`product` multiplies ``weight`` in int8 (int8 products on, a large
        weight, no autograd)."""
        return (
            self.int8_products
            and weight.numel() >= INT8_MIN_WEIGHTS
            and not torch.is_grad_enabled()
        )

    def product(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, name: str = "weight"
    ) -> Tensor:
        """:func:`linear` of ``weight`` (this module's, or derived from its parameters and
        cached under ``name``), whose :func:`pack_weight` is kept; with int8 products on, a
        large weight's :func:`int8_linear` instead, its int8 packing kept."""
        if self.multiplies_in_int8(weight):
            packed = self.cached(f"{name} int8", lambda: pack_int8(weight, bias))
            return int8_linear(x, packed)
        return linear(
            x, weight, bias, lambda: self.cached(f"{name} packed", lambda: pack_weight(weight))
        )

    def columns_product(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, columns: Tensor, name: str = "weight"
    ) -> Tensor:
        """:meth:`product`'s output channels ``columns`` alone, on the kernel it takes (the same
        bits per channel: :func:`columns_of`), made again only when ``columns`` is another
        tensor."""
        if self.multiplies_in_int8(weight):
            int8 = self.cached(f"{name} int8", lambda: pack_int8(weight, bias))
            whole = PreparedLinear(weight, bias, None, int8)
        elif uses_packed_products(x, weight):
            packed = self.cached(f"{name} packed", lambda: pack_weight(weight))
            whole = PreparedLinear(weight, bias, packed, None)
        else:
            return F.linear(x, weight[columns], None if bias is None else bias[columns])
        kept = self.cached(f"{name} columns", dict)
        if kept.get("columns") is not columns:
            kept.clear()  # the last columns' panels go before the next are made
            kept.update(columns=columns, product=columns_of(whole, weight, columns))
        return kept["product"](x)

    def train(self, mode: bool = True) -> InferenceCache:
        self._cache, self._cache_key = {}, None  # training may change parameters behind our back
        return super().train(mode)

    def _apply(self, fn, recurse=True):  # noqa: ANN001  (torch's private signature)
        self._cache, self._cache_key = {}, None  # parameters are being moved or cast
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_cache": {}, "_cache_key": None}


class Linear(InferenceCache, nn.Linear):
    """``nn.Linear`` (same parameters) computed with :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, self.weight, self.bias)

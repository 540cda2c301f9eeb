"""Matrix products of the model in inference on packed weights, on CPU: float32 through our
own kernel (beamplugin.kernels.float_products), half precisions through oneDNN's matmul; the
packing, and the load-time trial of ours against torch's at each weight's shape.

On CPU, ``F.linear`` runs float32 products through MKL, which on the AMD EPYC we measured is 1.6-2.4
times slower than oneDNN's matmul from 5 rows up, at every shape of these models (``python -m
benchmarks.kernels --kernels paths``; docs/speed.md), and picks other kernels for 1 to 3 rows, so a
row's result would depend on how many rows share its product. oneDNN's matmul in turn costs about 12
us a call whatever its size, most of a decoder step's product at a few rows; our kernel is called in
about 1 us and is as fast as oneDNN from about 40 rows. Both give a row the same bits whatever rows
are beside it, which makes a sentence decode bit for bit the same alone or batched, and differ from
``F.linear`` only in rounding (about 1e-6 relative). Where our kernel cannot be built (no C
compiler), float32 takes oneDNN's matmul too. Training keeps ``F.linear``: neither has an autograd
formula.

Given a plain weight, oneDNN lays it out in its blocked format on every product: a read and a
write of the whole weight on top of the product's own read. Modules keep a packed copy instead
(beamplugin.modules.inference_cache, beamplugin.modules.prepared_linear): faster when the
weight comes from memory rather than cache, as it does between decoder steps. A model cast to
bfloat16 or float16 packs its weights in that precision, on CPUs that multiply it in hardware
(beamplugin.fairseq_plugin.precision); under ``--bf16`` a float32 model's weights are packed in
bfloat16 for our kernel, which multiplies float32 rows on them (:func:`packs_bf16_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.kernels import float_products, native_library, trials
from beamplugin.kernels.float_products import Bf16Weights, Panels
from beamplugin.kernels.trials import TRIAL_ROWS, Trial


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


def pack_weight(weight: Tensor) -> PackedWeight | None:
    """``weight`` laid out for :func:`packed_product`: our kernels' panels for float32 where
    they are built and for bfloat16 on AVX512-BF16 CPUs, and faster than torch's at this shape
    (beamplugin.kernels.trials), else oneDNN's layout (None where torch has no packing)."""
    weight = weight.detach()
    if float_products.available(weight.dtype) and trials.ours_is_faster(
        "products", (str(weight.dtype), *weight.shape), lambda: _products_trial(weight)
    ):
        return float_products.pack(weight)
    return onednn_layout(weight)


def packs_bf16_weights(weight: Tensor) -> bool:
    """Whether ``--bf16`` packs ``weight`` in bfloat16 for float32 rows
    (beamplugin.kernels.float_products.Bf16Weights): float32, on the CPU, where our kernel runs
    (AVX512-BF16)."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and float_products.bf16_weights_available()
    )


def onednn_layout(weight: Tensor) -> Tensor | None:
    """``weight`` in oneDNN's blocked layout, None where torch has no packing for it."""
    if _onednn_pack is None or weight.dtype not in ONEDNN_DTYPES:
        return None
    return _onednn_pack(weight, None)


def _products_trial(weight: Tensor) -> Trial:
    """Our product kernel against torch's (oneDNN's on its packed weight, or ``F.linear``) at
    ``weight``'s shape."""
    ours = float_products.pack(weight)
    theirs = onednn_layout(weight)
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
        # float32 products norm in their call; bfloat16 weights' with the same norm kernel after
        float_rows = packed.values.dtype == torch.float32 or isinstance(packed, Bf16Weights)
        in_call = float_rows and norm is not None
        if in_call and norm.weight is not None and norm.bias is not None:
            affine = (norm.weight, norm.bias, norm.eps)
            return float_products.product(x, packed, bias, residual, relu, affine)
        return normed(float_products.product(x, packed, bias, residual, relu), norm)
    if residual is not None:
        return normed(_onednn_linear_binary(x, residual, packed, bias, "add"), norm)
    return normed(_onednn_linear(x, packed, bias, "relu" if relu else "none", [], ""), norm)


def normed(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
    """``x`` through ``norm`` (torch's), or ``x`` without one."""
    if norm is None:
        return x
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


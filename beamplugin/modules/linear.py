"""Matrix products of the model, routed to the fastest CPU kernel for large weights.

On CPU, ``F.linear`` runs float32 products through MKL. For the decoder's output projection
(vocabulary x embedding, a few to a few hundred rows per step) oneDNN's matmul takes 1.2 to 2.6
times less on the machine we measured, an AMD EPYC (``python scripts/bench_linear.py``); for
small weights MKL is as fast or faster. Results differ from ``F.linear`` only in rounding
(about 1e-6 relative). Training keeps ``F.linear``: the oneDNN op has no autograd formula.

Given a plain weight, oneDNN lays it out in its blocked format on every product: a read and a
write of the whole weight (8 MB for the projection) on top of the product's own read. Modules
keep a packed copy instead (:class:`InferenceCache`): 2.6x faster for 5 rows when the weight
comes from memory rather than cache, as it does between decoder steps, and bit-identical
results for any number of rows. A model cast to bfloat16 or float16 packs its weights in that
precision, on CPUs that multiply it in hardware (beamplugin.fairseq_plugin.precision).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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


# Weights with at least this many elements use oneDNN on CPU (a 8k x 256 vocabulary projection
# has 2M; the iwslt decoder's 768 x 512 convolution, 0.4M, is as fast with MKL).
ONEDNN_MIN_WEIGHTS = 1 << 20

_onednn_linear = (
    torch.ops.mkldnn._linear_pointwise
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    else None
)
_onednn_pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _onednn_linear else None
# Half-precision weights only where the CPU multiplies them in hardware: elsewhere oneDNN cannot
# pack them (and torch's emulated products are slower than float32: docs/precision.md).
ONEDNN_DTYPES = frozenset(
    dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    if _onednn_linear is not None and native_on_cpu(dtype)
)


# With int8 products on (--int8), weights of at least this many elements: the vocabulary
# projection and the decoder convolutions (0.4M in iwslt's decoder); attention
# projections (65k there) stay float32.
INT8_MIN_WEIGHTS = 1 << 17


def pack_int8(weight: Tensor, bias: Tensor | None) -> Any:
    """``weight`` quantized to int8 per output channel (symmetric, scale max |w| / 127) and
    packed with ``bias`` for :func:`int8_linear` (torch's x86 quantized engine, fbgemm)."""
    w = weight.detach().float()
    scales = (w.abs().amax(1) / 127).clamp(min=1e-12).double()
    zero_points = torch.zeros(w.size(0), dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(
        quantized, None if bias is None else bias.detach().float()
    )


def int8_linear(x: Tensor, packed: Any, out_features: int) -> Tensor:
    """``F.linear`` with a :func:`pack_int8` weight: the rows of ``x`` are quantized to 8 bits
    per product (one scale for all of them), multiplied in int8 and scaled back to float32."""
    # reduce_range: 7-bit activations, so that AVX2's 16-bit sums of pairs cannot saturate
    out = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.size(-1)), packed, True)
    return out.view(*x.shape[:-1], out_features)


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        _onednn_linear is not None
        and weight.numel() >= ONEDNN_MIN_WEIGHTS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.dtype in ONEDNN_DTYPES
        and not torch.is_grad_enabled()
    )


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    packed: Callable[[], Tensor | None] | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where that is faster (see module doc).
    ``packed``, if given, returns :func:`pack_weight` of ``weight``; it is only called on the
    oneDNN path (a cache lookup or a packing that the other path does not need)."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    layout = packed() if packed is not None else None
    out = _onednn_linear(
        x.reshape(-1, x.size(-1)), weight if layout is None else layout, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], weight.size(0))


def pack_weight(weight: Tensor) -> Tensor | None:
    """``weight`` in oneDNN's own layout for :func:`linear` (None where torch has no packing)."""
    return None if _onednn_pack is None else _onednn_pack(weight, None)


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

    def product(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, name: str = "weight"
    ) -> Tensor:
        """:func:`linear` of ``weight`` (this module's, or derived from its parameters and
        cached under ``name``), whose oneDNN packing is kept; with int8 products on, a large
        weight's :func:`int8_linear` instead, its int8 packing kept."""
        if (
            self.int8_products
            and weight.numel() >= INT8_MIN_WEIGHTS
            and not torch.is_grad_enabled()
        ):
            packed = self.cached(f"{name} int8", lambda: pack_int8(weight, bias))
            return int8_linear(x, packed, weight.size(0))
        return linear(
            x, weight, bias, lambda: self.cached(f"{name} packed", lambda: pack_weight(weight))
        )

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

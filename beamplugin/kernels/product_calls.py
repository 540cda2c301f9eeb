"""The Python side of ``native/product_calls.h``: a packed weight as the C steps in one call
(beamplugin.kernels.transformer_layers, beamplugin.kernels.convs2s_layers) multiply it, and
the addresses of the product kernels they call through pointers."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from torch import Tensor

from beamplugin.kernels import bf16_kernels, float_products, int8_products, native_library
from beamplugin.kernels.float_products import Bf16Weights, Panels
from beamplugin.kernels.int8_products import Int8Panels

Norm = tuple[Tensor, Tensor, float]  # weight, bias, eps
_P = ctypes.c_void_p
_I = ctypes.c_int64


class Product(NamedTuple):
    """A packed weight (float32, bfloat16 for float32 rows, or int8 with its channel scales), its
    bias, and the post-norm its call applies (or None)."""

    panels: Panels | Int8Panels
    bias: Tensor | None
    norm: Norm | None
    scales: Tensor | None = None  # an int8 weight's, per output channel


class ProductCall(ctypes.Structure):  # product_calls.h's struct product
    _fields_ = [("panels", _P), ("sums", _P), ("scales", _P), ("bias", _P), ("gamma", _P),
                ("beta", _P), ("eps", ctypes.c_float), ("out", _I), ("inner", _I),
                ("bf16", ctypes.c_int)]  # fmt: skip


class ProductKernels(NamedTuple):
    """The product kernels' addresses (int8 and bf16 None where this CPU has no such kernel:
    no weight is then given their panels)."""

    products: int
    int8: int | None
    bf16: int | None
    norm: int


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def product_call(product: Product | None, int8_kernel: int | None) -> ProductCall:
    """``product`` as the C steps read it (None: an empty one, a product a layer has not)."""
    if product is None:
        return ProductCall()
    gamma, beta, eps = product.norm or (None, None, 0.0)
    panels = product.panels
    int8, bf16 = isinstance(panels, Int8Panels), isinstance(panels, Bf16Weights)
    if int8 and (int8_kernel is None or product.scales is None):
        raise ValueError("int8 panels need this CPU's int8 kernel and their scales")
    if bf16 and not float_products.bf16_weights_available():
        raise ValueError("bfloat16 panels need this CPU's bfloat16 kernel")
    tensors = [product.bias, product.scales, gamma, beta]
    if any(t is not None and not t.is_contiguous() for t in tensors):
        raise ValueError("biases, scales and norm weights must be contiguous")
    return ProductCall(
        panels.values.data_ptr(), panels.sums.data_ptr() if int8 else None,
        _pointer(product.scales), _pointer(product.bias), _pointer(gamma), _pointer(beta), eps,
        panels.out_features, panels.in_features, int(bf16),
    )  # fmt: skip


@native_library.cached
def product_kernels() -> ProductKernels | None:
    """The addresses of the product and norm kernels (None where they cannot be built)."""
    products = native_library.address("products", "products")
    norm = native_library.address("products", "layer_norm_rows")
    if products is None or norm is None:
        return None
    int8 = native_library.address("int8_products", "int8_products")
    int8 = int8 if int8_products.available() else None
    bf16 = bf16_kernels.address() if float_products.bf16_weights_available() else None
    return ProductKernels(products, int8, bf16, norm)

"""Tensors derived from a module's parameters for inference (a folded, re-laid-out, packed or
int8 weight), kept while those parameters are unchanged; and the module's products on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.modules.int8_weights import large_for_int8
from beamplugin.modules.packed_weights import packs_bf16_weights, uses_packed_products
from beamplugin.modules.plain_linear import plain_linear
from beamplugin.modules.prepared_linear import PreparedLinear, columns_of, prepare_linear


class InferenceCache(nn.Module):
    """Keeps tensors derived from a module's parameters for inference (a folded, re-laid-out,
    packed or int8 weight) while those parameters are unchanged.

    Entries are keyed by the version counters and storage of the module's own parameters, so a state
    dict load or a torch optimizer step renews them; fairseq's optimizers write through ``p.data``,
    which bumps nothing, but run between ``train()`` and ``eval()``, which both drop the cache, as
    do moves and casts (``_apply``). Copies and pickles leave it out (packed oneDNN tensors cannot
    be copied).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the module's own arguments (nn.Linear's)
        self._cache: dict[str, Tensor | None] = {}
        self._cache_key: tuple[tuple[int, int], ...] | None = None
        # set by beamplugin.fairseq_plugin.precision.cast_for_decoding
        self.int8_products = False
        self.bf16_products = False  # float32 rows on bfloat16 weights (--bf16)

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
        return self.int8_products and large_for_int8(weight) and not torch.is_grad_enabled()

    def product(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, name: str = "weight"
    ) -> Tensor:
        """``F.linear(x, weight, bias)`` (``weight`` this module's, or derived from its
        parameters and cached under ``name``): in inference on CPU on its
        :func:`~beamplugin.modules.prepared_linear.prepare_linear`, kept (packed, or in int8
        with int8 products on and a large weight), else :func:`plain_linear`."""
        prepared = self._prepared(x, weight, bias, name)
        if prepared is None:
            return plain_linear(x, weight, bias)
        return prepared(x.reshape(-1, x.size(-1))).view(*x.shape[:-1], weight.size(0))

    def product_plus(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, other: Tensor, name: str = "weight"
    ) -> Tensor:
        """:meth:`product` plus ``other`` (a residual of the product's shape), the sum in the
        product's call where a prepared weight takes it (the same bits as the sum after it)."""
        prepared = self._prepared(x, weight, bias, name)
        if prepared is None:
            return plain_linear(x, weight, bias) + other
        rows = prepared.plus(x.reshape(-1, x.size(-1)), other.reshape(-1, other.size(-1)))
        return rows.view(*x.shape[:-1], weight.size(0))

    def columns_product(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, columns: Tensor, name: str = "weight"
    ) -> Tensor:
        """:meth:`product`'s output channels ``columns`` alone, on the kernel it takes (the same
        bits per channel: :func:`columns_of`), made again only when ``columns`` is another
        tensor."""
        whole = self._prepared(x, weight, bias, name)
        if whole is None:
            return F.linear(x, weight[columns], None if bias is None else bias[columns])
        kept = self.cached(f"{name} columns", dict)
        if kept.get("columns") is not columns:
            kept.clear()  # the last columns' panels go before the next are made
            kept.update(columns=columns, product=columns_of(whole, weight, columns))
        return kept["product"](x)

    def _prepared(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, name: str
    ) -> PreparedLinear | None:
        """``weight`` made ready for ``x``'s product and kept, None where it takes torch's."""
        int8 = self.multiplies_in_int8(weight)
        if not int8 and not uses_packed_products(x, weight):
            return None
        bf16 = not int8 and self.bf16_products and packs_bf16_weights(weight)
        kind = "int8" if int8 else "bf16" if bf16 else "packed"
        return self.cached(f"{name} {kind}", lambda: prepare_linear(weight, bias, int8, bf16=bf16))

    def train(self, mode: bool = True) -> InferenceCache:
        self._cache, self._cache_key = {}, None  # training may change parameters behind our back
        return super().train(mode)

    def _apply(self, fn, recurse=True):  # noqa: ANN001  (torch's private signature)
        self._cache, self._cache_key = {}, None  # parameters are being moved or cast
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_cache": {}, "_cache_key": None}

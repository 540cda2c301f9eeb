"""Weight normalisation whose reparametrisation is folded into a plain weight for inference."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from beamplugin.modules.inference_cache import InferenceCache


class FoldedWeightNorm(InferenceCache):
    """A weight kept as ``w = g * v / ||v||`` (norm over every dim but ``norm_dim``).

    The parameters carry the names torch.nn.utils.weight_norm gives them (``weight_g``,
    ``weight_v``) so fairseq fconv checkpoints load unchanged. While autograd records, ``weight``
    is recomputed on every access so gradients reach g and v. Without autograd (decoding,
    validation) it is folded once and reused until g or v change (see :class:`InferenceCache`).
    """

    def __init__(self, weight: Tensor, bias: Tensor, norm_dim: int) -> None:
        super().__init__()
        self.norm_dim = norm_dim
        self.bias = nn.Parameter(bias)
        self.weight_g = nn.Parameter(torch.norm_except_dim(weight, 2, norm_dim))
        self.weight_v = nn.Parameter(weight)

    @property
    def weight(self) -> Tensor:
        if torch.is_grad_enabled():
            return self._fold()
        return self.cached("weight", self._fold)

    def _fold(self) -> Tensor:
        v, g = self.weight_v, self.weight_g
        if v.dtype == torch.float32:
            return torch._weight_norm(v, g, self.norm_dim)
        # half precision: norm and scaling in float32, one rounding of the folded weight
        return torch._weight_norm(v.float(), g.float(), self.norm_dim).to(v.dtype)

    def derived_weight(self, name: str, derive: Callable[[Tensor], Tensor]) -> Tensor:
        """``derive(weight)`` (e.g. another layout for decoding), cached with the folded weight."""
        if torch.is_grad_enabled():
            return derive(self.weight)
        return self.cached(name, lambda: derive(self.weight))


class WeightNormLinear(FoldedWeightNorm):
    """Linear layer with fconv's initialisation (std sqrt((1 - dropout) / in_features))."""

    def __init__(self, in_features: int, out_features: int, dropout: float = 0.0) -> None:
        weight = torch.empty(out_features, in_features)
        nn.init.normal_(weight, mean=0.0, std=math.sqrt((1.0 - dropout) / in_features))
        super().__init__(weight, torch.zeros(out_features), norm_dim=0)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, self.weight, self.bias)

    def plus(self, x: Tensor, other: Tensor) -> Tensor:
        """``self(x) + other``, the sum in the product's call where it can be (same bits)."""
        return self.product_plus(x, self.weight, self.bias, other)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

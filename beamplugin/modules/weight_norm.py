"""Weight normalisation whose reparametrisation is folded into a plain weight for inference."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from beamplugin.modules.linear import linear


class FoldedWeightNorm(nn.Module):
    """A weight kept as ``w = g * v / ||v||`` (norm over every dim but ``norm_dim``).

    The parameters carry the names torch.nn.utils.weight_norm gives them (``weight_g``,
    ``weight_v``) so fairseq fconv checkpoints load unchanged. While autograd records, ``weight``
    is recomputed on every access so gradients reach g and v. Without autograd (decoding,
    validation) it is folded once and reused until g or v change: a state dict load or a torch
    optimizer step bumps their version counters, a device or dtype move goes through
    ``_apply``, and fairseq's optimizers, which write through ``p.data`` and bump nothing, run
    between ``train()`` and ``eval()``, which both drop the cache.
    """

    def __init__(self, weight: Tensor, bias: Tensor, norm_dim: int) -> None:
        super().__init__()
        self.norm_dim = norm_dim
        self.bias = nn.Parameter(bias)
        self.weight_g = nn.Parameter(torch.norm_except_dim(weight, 2, norm_dim))
        self.weight_v = nn.Parameter(weight)
        self._cache: dict[str, Tensor] = {}
        self._cache_key: tuple[int, int, int, int] | None = None

    @property
    def weight(self) -> Tensor:
        if torch.is_grad_enabled():
            return torch._weight_norm(self.weight_v, self.weight_g, self.norm_dim)
        return self._folded()["weight"]

    def derived_weight(self, name: str, derive: Callable[[Tensor], Tensor]) -> Tensor:
        """``derive(weight)`` (e.g. another layout for decoding), cached under ``name`` along
        with the folded weight."""
        if torch.is_grad_enabled():
            return derive(self.weight)
        cache = self._folded()
        if name not in cache:
            cache[name] = derive(cache["weight"])
        return cache[name]

    def _folded(self) -> dict[str, Tensor]:
        """The folded weight and what was derived from it, refreshed when g or v changed."""
        g, v = self.weight_g, self.weight_v
        key = (g._version, v._version, g.data_ptr(), v.data_ptr())
        if key != self._cache_key:
            self._cache = {"weight": torch._weight_norm(v, g, self.norm_dim)}
            self._cache_key = key
        return self._cache

    def train(self, mode: bool = True) -> FoldedWeightNorm:
        self._cache, self._cache_key = {}, None  # training may change g and v behind our back
        return super().train(mode)

    def _apply(self, fn, recurse=True):  # noqa: ANN001  (torch's private signature)
        self._cache, self._cache_key = {}, None  # parameters are being moved or cast
        return super()._apply(fn, recurse)


class WeightNormLinear(FoldedWeightNorm):
    """Linear layer with fconv's initialisation (std sqrt((1 - dropout) / in_features))."""

    def __init__(self, in_features: int, out_features: int, dropout: float = 0.0) -> None:
        weight = torch.empty(out_features, in_features)
        nn.init.normal_(weight, mean=0.0, std=math.sqrt((1.0 - dropout) / in_features))
        super().__init__(weight, torch.zeros(out_features), norm_dim=0)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

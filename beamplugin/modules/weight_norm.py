"""Weight normalisation whose reparametrisation is folded into a plain weight for inference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FoldedWeightNorm(nn.Module):
    """A weight kept as ``w = g * v / ||v||`` (norm over every dim but ``norm_dim``).

    The parameters carry the names torch.nn.utils.weight_norm gives them (``weight_g``,
    ``weight_v``) so fairseq fconv checkpoints load unchanged. While autograd records, ``weight``
    is recomputed on every access so gradients reach g and v. Without autograd (decoding,
    validation) it is folded once and reused until g or v change: an optimizer step or a state
    dict load bumps their version counters, a device or dtype move goes through ``_apply``.
    """

    def __init__(self, weight: Tensor, bias: Tensor, norm_dim: int) -> None:
        super().__init__()
        self.norm_dim = norm_dim
        self.bias = nn.Parameter(bias)
        self.weight_g = nn.Parameter(torch.norm_except_dim(weight, 2, norm_dim))
        self.weight_v = nn.Parameter(weight)
        self._folded: Tensor | None = None
        self._folded_key: tuple[int, int, int, int] | None = None

    @property
    def weight(self) -> Tensor:
        g, v = self.weight_g, self.weight_v
        if torch.is_grad_enabled():
            return torch._weight_norm(v, g, self.norm_dim)
        key = (g._version, v._version, g.data_ptr(), v.data_ptr())
        if self._folded is None or key != self._folded_key:
            self._folded = torch._weight_norm(v, g, self.norm_dim)
            self._folded_key = key
        return self._folded

    def _apply(self, fn, recurse=True):  # noqa: ANN001  (torch's private signature)
        self._folded = None  # parameters are being moved or cast
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
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

"""``nn.Linear`` whose inference products run on its kept packed or int8 weight
(beamplugin.modules.inference_cache)."""

from __future__ import annotations

from torch import Tensor, nn

from beamplugin.modules.inference_cache import InferenceCache


class Linear(InferenceCache, nn.Linear):
    """``nn.Linear`` (same parameters) computed with :meth:`InferenceCache.product`."""

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, self.weight, self.bias)

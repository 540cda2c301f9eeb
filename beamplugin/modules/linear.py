"""Matrix products of the model, routed to the fastest CPU kernel for large weights.

On CPU, ``F.linear`` runs float32 products through MKL. For the decoder's output projection
(vocabulary x embedding, a few to a few hundred rows per step) oneDNN's matmul takes 1.2 to 2.6
times less on the machine we measured, an AMD EPYC (``python scripts/bench_linear.py``); for
small weights MKL is as fast or faster. Results differ from ``F.linear`` only in rounding
(about 1e-6 relative). Training keeps ``F.linear``: the oneDNN op has no autograd formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Weights with at least this many elements use oneDNN on CPU (a 8k x 256 vocabulary projection
# has 2M; the iwslt decoder's 768 x 512 convolution, 0.4M, is as fast with MKL).
ONEDNN_MIN_WEIGHTS = 1 << 20

_onednn_linear = (
    torch.ops.mkldnn._linear_pointwise
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    else None
)


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        _onednn_linear is not None
        and weight.numel() >= ONEDNN_MIN_WEIGHTS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where that is faster (see module doc)."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.size(-1))
    out = _onednn_linear(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.size(0))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters) computed with :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

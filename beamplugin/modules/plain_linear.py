"""torch's own product, where no packed or int8 weight takes it (autograd, a GPU, a dtype the
CPU does not multiply in hardware); on a GPU in float32 made independent of how many rows share
it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_CHUNK = 64  # rows a float32 product takes on a GPU at once (see rows_in_chunks)


def plain_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)``; float32 inference on a GPU in :func:`rows_in_chunks`."""
    if x.is_cuda and x.dtype == torch.float32 and not torch.is_grad_enabled():
        rows = rows_in_chunks(x.reshape(-1, x.size(-1)), weight, bias)
        return rows.view(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)


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

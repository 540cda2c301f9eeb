"""Attention whose result for a batch entry does not depend on the other entries, nor on masked
columns after its own: the fixed-rows decoders' (beamplugin.models.fixed_rows_transformer,
beamplugin.models.fixed_rows_convs2s)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def attend(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """``softmax(query @ keys^T) @ values`` of ``query`` ``[batch, heads, queries, dim]``
    (scaled already) over ``keys`` and ``values`` ``[batch, heads, width, dim]`` where ``mask``
    ``[batch, 1, 1, width]`` holds.

    On a GPU one fused kernel (a block of its grid per batch entry and head: what an entry gets
    does not depend on the others; masked key blocks after its own add exact zeros). On the CPU
    torch's fused attention and batched products take other paths for other batch sizes, so
    there the products are sums over the last dimension, the same for every entry whatever the
    batch."""
    if query.is_cuda:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=1.0)
    scores = (query.unsqueeze(3) * keys.unsqueeze(2)).sum(-1)  # batch, heads, queries, width
    scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(values.dtype)
    return (probs.unsqueeze(-1) * values.unsqueeze(2)).sum(-2)


def own_columns(own: Tensor) -> tuple[Tensor, Tensor]:
    """For sources left-padded in ``own`` ``[sentences, width]`` (True at a sentence's own
    positions, its last ones): per sentence and column ``j`` the column its ``j``-th own
    position is in (``[sentences, width]``, clamped past its end), and where ``j`` is one of
    its own (the mask of the same sources left-aligned)."""
    width = own.size(1)
    lengths = own.sum(1)
    columns = torch.arange(width, device=own.device)
    taken = (columns + (width - lengths).unsqueeze(1)).clamp_(max=width - 1)
    return taken, columns < lengths.unsqueeze(1)

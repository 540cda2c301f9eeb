"""ConvS2S attention (Gehring et al. 2017) of a decoder layer over the encoder output."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.kernels import sentence_attention
from beamplugin.modules.memory_pool import Layout, MemoryPool, Pooled
from beamplugin.modules.weight_norm import WeightNormLinear

SQRT_HALF = math.sqrt(0.5)

EncoderMemory = dict[str, Tensor | None]

# How a memory pool keeps what encoder_memory prepares (bias left out: no padding)
ATTENTION_MEMORY_LAYOUT: Layout = {
    "keys": Pooled(width_dim=2, padding=0.0),
    "values": Pooled(width_dim=1, padding=0.0),
    "bias": Pooled(width_dim=2, padding=-math.inf, optional_rank=3),
    "scale": Pooled(width_dim=None, padding=0.0),
}


def attention_memory_pool(embed: int) -> MemoryPool:
    """An empty pool for the attention memory (``embed``-wide keys) of the sentences in
    flight."""
    return MemoryPool(ATTENTION_MEMORY_LAYOUT, embed)


def encoder_memory(encoder_out: dict) -> EncoderMemory:
    """What every attention layer reads from the encoder, prepared once per sentence.

    keys: batch x embed x src_len (transposed once for the score product), values:
    batch x src_len x embed, bias: batch x 1 x src_len, -inf at padding (added to the scores
    by their product: no masking step), or None without padding, scale: batch x 1 x 1,
    sqrt(number of real source tokens), which undoes the averaging of the attention read-out.
    """
    keys, values = encoder_out["encoder_out"]
    padding_mask = encoder_out["encoder_padding_mask"]
    src_len = values.size(1)
    # real tokens per sentence; every sentence scaled with fconv's unpadded formula (n *
    # sqrt(1 / n) in double): its float32 rsqrt for padded ones can differ in the last bit, and
    # a sentence's scores would then depend on whether a batch-mate made it padded
    lengths = values.new_full((values.size(0), 1, 1), src_len, dtype=torch.float64)
    bias = None
    if padding_mask is not None:
        lengths -= padding_mask.double().sum(dim=1).view(-1, 1, 1)
        bias = values.new_zeros(padding_mask.shape).masked_fill_(padding_mask, -math.inf)
        bias = bias.unsqueeze(1)
    scale = (lengths * lengths.reciprocal().sqrt()).to(values.dtype)
    return {
        "keys": keys.transpose(1, 2).contiguous(),
        "values": values,
        "bias": bias,
        "scale": scale,
    }


class ConvAttention(nn.Module):
    """Dot-product attention of decoder states, combined with the target embedding, over the
    encoder output; adds the projected context back to the decoder state (scaled residual)."""

    def __init__(self, conv_channels: int, embed_dim: int) -> None:
        super().__init__()
        self.in_projection = WeightNormLinear(conv_channels, embed_dim)
        self.out_projection = WeightNormLinear(embed_dim, conv_channels)

    def forward(
        self,
        x: Tensor,
        target_embedding: Tensor,
        groups: list[tuple[EncoderMemory, int]],
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """x: rows x tgt_len x conv_channels; returns it updated and the attention weights,
        rows x tgt_len x src_len (None unless ``need_weights``).

        ``groups``: the rows, in order, as groups of (the memory of its sentences, one row per
        sentence, number of rows). A group's rows may be a multiple of its sentences,
        sentence-major (the beams of a sentence in a beam search): they share their sentence's
        encoder rows, so a step attends with one product per sentence and the memory is never
        copied per beam. Groups may differ in rows per sentence and in source width (a pool's
        sentences at their first step, or of a narrower width block); their attention weights
        are left-padded to the widest.
        """
        rows, steps = x.shape[:2]
        residual = x
        # the sums in the products' calls, the scalings in place: a step's rows go over
        # memory once less each
        query = self.in_projection.plus(x, target_embedding).mul_(SQRT_HALF)
        if len(groups) == 1:  # also in training: autograd cannot write into an output buffer
            context, attn = _attend(query, groups[0][0], need_weights)
        else:
            context = torch.empty_like(query)  # each group writes its rows (no copy to join)
            attended, first = [], 0
            for memory, group_rows in groups:
                rows_of_group = slice(first, first + group_rows)
                out = context[rows_of_group].view(memory["keys"].size(0), -1, context.size(2))
                attended.append(_attend(query[rows_of_group], memory, need_weights, out))
                first += group_rows
            if need_weights:
                width = max(a.size(-1) for _, a in attended)
                attn = torch.cat(
                    [F.pad(a.flatten(0, 1), (width - a.size(-1), 0)) for _, a in attended]
                )
        context = context.reshape(rows, steps, -1)
        x = self.out_projection.plus(context, residual).mul_(SQRT_HALF)
        return x, attn.reshape(rows, steps, -1) if need_weights else None


def _attend(
    query: Tensor, memory: EncoderMemory, need_weights: bool, out: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Context ``[sentences, rows x steps, embed]`` (written to ``out`` if given) and attention
    weights (None where not ``need_weights`` and our kernel attends) of ``query`` (rows x steps x
    embed, sentence-major) over the memory of its sentences."""
    sentences = memory["keys"].size(0)
    query = query.view(sentences, -1, query.size(2))
    if sentence_attention.serves(query):
        if out is None:  # of the memory's kind, as torch's products of it are
            out = memory["values"].new_empty(query.shape)
        attn = sentence_attention.attend(
            query, memory["keys"], memory["values"], memory["bias"], memory["scale"],
            out.view(-1, query.size(2)), need_weights,
        )  # fmt: skip
        return out, attn
    if memory["bias"] is None:
        scores = torch.bmm(query, memory["keys"])
    else:
        scores = torch.baddbmm(memory["bias"], query, memory["keys"])
    attn = F.softmax(scores, dim=-1)
    return torch.mul(torch.bmm(attn, memory["values"]), memory["scale"], out=out), attn

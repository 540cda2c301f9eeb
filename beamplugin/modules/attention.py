"""ConvS2S attention (Gehring et al. 2017) of a decoder layer over the encoder output."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.modules.weight_norm import WeightNormLinear

SQRT_HALF = math.sqrt(0.5)

EncoderMemory = dict[str, Tensor | None]


def encoder_memory(encoder_out: dict) -> EncoderMemory:
    """What every attention layer reads from the encoder, prepared once per sentence.

    keys: batch x embed x src_len (transposed once for the score product), values:
    batch x src_len x embed, padding_mask: batch x 1 x src_len or None, scale: batch x 1 x 1,
    sqrt(number of real source tokens), which undoes the averaging of the attention read-out.
    """
    keys, values = encoder_out["encoder_out"]
    padding_mask = encoder_out["encoder_padding_mask"]
    src_len = values.size(1)
    if padding_mask is None:
        scale = values.new_full((values.size(0), 1, 1), src_len * math.sqrt(1.0 / src_len))
    else:
        lengths = src_len - padding_mask.type_as(values).sum(dim=1, keepdim=True).unsqueeze(-1)
        scale = lengths * lengths.rsqrt()
        padding_mask = padding_mask.unsqueeze(1)
    return {
        "keys": keys.transpose(1, 2).contiguous(),
        "values": values,
        "padding_mask": padding_mask,
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
        self, x: Tensor, target_embedding: Tensor, memory: EncoderMemory
    ) -> tuple[Tensor, Tensor]:
        """x: rows x tgt_len x conv_channels; returns it updated and the attention weights,
        rows x tgt_len x src_len.

        ``memory`` holds one row per sentence; ``rows`` may be a multiple of it, sentence-major
        (the beams of a sentence in a beam search): they share their sentence's encoder rows,
        so a step attends with one product per sentence and the memory is never copied per beam.
        """
        rows, steps = x.shape[:2]
        sentences = memory["keys"].size(0)
        residual = x
        query = (self.in_projection(x) + target_embedding) * SQRT_HALF
        scores = torch.bmm(query.view(sentences, -1, query.size(2)), memory["keys"])
        if memory["padding_mask"] is not None:
            scores = scores.masked_fill(memory["padding_mask"], float("-inf"))
        attn = F.softmax(scores, dim=-1)
        context = torch.bmm(attn, memory["values"]) * memory["scale"]
        context = context.view(rows, steps, -1)
        return (self.out_projection(context) + residual) * SQRT_HALF, attn.view(rows, steps, -1)

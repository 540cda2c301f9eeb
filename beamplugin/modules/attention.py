"""ConvS2S attention (Gehring et al. 2017) of a decoder layer over the encoder output."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beamplugin.modules.weight_norm import WeightNormLinear
from beamplugin.runtime.host_transfer import to_device

SQRT_HALF = math.sqrt(0.5)

EncoderMemory = dict[str, Tensor | None]


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
    bias = None
    if padding_mask is None:
        scale = values.new_full((values.size(0), 1, 1), src_len * math.sqrt(1.0 / src_len))
    else:
        # counted in float32: bfloat16 holds integers exactly only up to 256
        lengths = src_len - padding_mask.float().sum(dim=1, keepdim=True).unsqueeze(-1)
        scale = (lengths * lengths.rsqrt()).to(values.dtype)
        bias = values.new_zeros(padding_mask.shape).masked_fill_(padding_mask, -math.inf)
        bias = bias.unsqueeze(1)
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
        query = (self.in_projection(x) + target_embedding) * SQRT_HALF
        if len(groups) == 1:  # also in training: autograd cannot write into an output buffer
            context, attn = _attend(query, groups[0][0])
        else:
            context = torch.empty_like(query)  # each group writes its rows (no copy to join)
            attended, first = [], 0
            for memory, group_rows in groups:
                rows_of_group = slice(first, first + group_rows)
                out = context[rows_of_group].view(memory["keys"].size(0), -1, context.size(2))
                attended.append(_attend(query[rows_of_group], memory, out))
                first += group_rows
            if need_weights:
                width = max(a.size(-1) for _, a in attended)
                attn = torch.cat(
                    [F.pad(a.flatten(0, 1), (width - a.size(-1), 0)) for _, a in attended]
                )
        context = context.reshape(rows, steps, -1)
        x = (self.out_projection(context) + residual) * SQRT_HALF
        return x, attn.reshape(rows, steps, -1) if need_weights else None


def _attend(
    query: Tensor, memory: EncoderMemory, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Context ``[sentences, rows x steps, embed]`` (written to ``out`` if given) and attention
    weights of ``query`` (rows x steps x embed, sentence-major) over the memory of its
    sentences."""
    sentences = memory["keys"].size(0)
    query = query.view(sentences, -1, query.size(2))
    if memory["bias"] is None:
        scores = torch.bmm(query, memory["keys"])
    else:
        scores = torch.baddbmm(memory["bias"], query, memory["keys"])
    attn = F.softmax(scores, dim=-1)
    return torch.mul(torch.bmm(attn, memory["values"]), memory["scale"], out=out), attn


class AttentionMemoryPool:
    """The attention memory of the sentences in flight, one slot per sentence, for a decoder
    that mixes sentences of different steps in one forward (see beamplugin.engine.ensemble).

    Slots are rows of preallocated tensors (as :func:`encoder_memory` lays them out), all as wide
    as the widest source in flight, shorter ones left-padded and masked (bias -inf). A new
    sentence is written into its slot, a leaving one is replaced by moving a later sentence into
    its slot: no step copies the whole pool. The pool widens when a longer source arrives and
    narrows once the sources in flight need less than half its width. The decoder reads it in
    groups of consecutive slots, each cut to the widest source among them: the attention
    products grow with the positions they read.
    """

    def __init__(self) -> None:
        self.memory: EncoderMemory = {}
        self.widths: list[int] = []  # per live slot: its source width (own padding included)
        # views made since the slots last changed, by groups: most steps at a small capacity
        # neither admit nor retire a sentence
        self._views: dict[tuple[tuple[int, int], ...], dict] = {}

    @property
    def width(self) -> int:
        return self.memory["values"].size(1) if self.memory else 0

    def write(self, first_slot: int, encoder_out: dict, rows: slice, width: int) -> None:
        """Put rows ``rows`` of ``encoder_out`` (sources of at most ``width`` positions, the
        last ones: sources are left-padded) at slots ``first_slot`` on."""
        self._views.clear()
        source = encoder_out["attention_memory"]
        new = _narrowed(source, rows, width)
        count = new["values"].size(0)
        if first_slot == 0:  # a new batch: its memory becomes the pool
            if new["values"].shape != source["values"].shape:
                # part of an encoder output that other sentences still wait to use: a copy
                new = {k: None if t is None else t.clone() for k, t in new.items()}
            self.memory, self.widths = new, [width] * count
            return
        self.widths = self.widths[:first_slot] + [width] * count
        width = max(self.widths)
        capacity = self.memory["keys"].size(0)
        if capacity < first_slot + count:
            capacity = 2 * (first_slot + count)  # room to grow without reallocating each time
        if (
            self.memory["bias"] is None
            or self.width != width
            or capacity != self.memory["keys"].size(0)
        ):
            self._reallocate(first_slot, capacity, width)
        slots = slice(first_slot, first_slot + count)
        pad = width - new["values"].size(1)
        self.memory["keys"][slots, :, :pad] = 0
        self.memory["keys"][slots, :, pad:] = new["keys"]
        self.memory["values"][slots, :pad] = 0
        self.memory["values"][slots, pad:] = new["values"]
        self.memory["bias"][slots, :, :pad] = -math.inf
        self.memory["bias"][slots, :, pad:] = 0 if new["bias"] is None else new["bias"]
        self.memory["scale"][slots] = new["scale"]

    def _reallocate(self, live: int, capacity: int, width: int) -> None:
        """New tensors of ``capacity`` slots and ``width``; the first ``live`` slots kept."""
        old, kept = self.memory, min(width, self.width)
        keys, values = old["keys"], old["values"]
        self.memory = {
            "keys": keys.new_zeros(capacity, keys.size(1), width),
            "values": values.new_zeros(capacity, width, values.size(2)),
            "bias": values.new_full((capacity, 1, width), -math.inf),
            "scale": old["scale"].new_zeros(capacity, 1, 1),
        }
        self.memory["keys"][:live, :, -kept:] = keys[:live, :, -kept:]
        self.memory["values"][:live, -kept:] = values[:live, -kept:]
        if old["bias"] is None:
            self.memory["bias"][:live, :, -kept:] = 0
        else:
            self.memory["bias"][:live, :, -kept:] = old["bias"][:live, :, -kept:]
        self.memory["scale"][:live] = old["scale"][:live]

    def rearrange(self, order: list[int]) -> None:
        self._views.clear()
        moved = [(slot, old) for slot, old in enumerate(order) if slot != old]
        self.widths = [self.widths[old] for old in order]
        if moved:
            slots, olds = to_device(list(zip(*moved, strict=True)), self.memory["keys"].device)
            for tensor in self.memory.values():
                if tensor is not None:
                    tensor.index_copy_(0, slots, tensor.index_select(0, olds))
        if self.widths and 2 * max(self.widths) < self.width:
            self._reallocate(len(order), self.memory["keys"].size(0), max(self.widths))

    def view(self, groups: list[tuple[int, int]]) -> dict:
        """The encoder output that the decoder reads: for each group of slots, from the first
        on, (sentences, decoder rows each), their memory cut to the widest of them."""
        key = tuple(groups)
        if key not in self._views:
            attention_groups, slot = [], 0
            for sentences, rows_each in groups:
                slots = slice(slot, slot + sentences)
                memory = _narrowed(self.memory, slots, max(self.widths[slots]))
                attention_groups.append((memory, sentences * rows_each))
                slot += sentences
            self._views[key] = {"attention_groups": attention_groups}
        return self._views[key]


def _narrowed(memory: EncoderMemory, rows: slice, width: int) -> EncoderMemory:
    """Rows ``rows`` of an attention memory, cut to its last ``width`` source positions."""
    keys, values, bias = memory["keys"], memory["values"], memory["bias"]
    return {
        "keys": keys[rows, :, keys.size(2) - width :],
        "values": values[rows, values.size(1) - width :],
        "bias": None if bias is None else bias[rows, :, bias.size(2) - width :],
        "scale": memory["scale"][rows],
    }

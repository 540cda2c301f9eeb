"""One step of batched beam search as pure tensor code (no model, no host synchronisation).

Conventions follow fairseq's ``BeamSearch`` + ``SequenceGenerator`` so that outputs are identical:
one ``torch.topk`` over ``beam x vocab`` takes ``2 x beam`` candidates (so that at least ``beam``
of them do not end in EOS), an EOS candidate finishes a hypothesis only when it ranks inside the
top ``beam`` slots, and the next beam is made of the first ``beam`` non-EOS candidates in rank
order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class BeamStep(NamedTuple):
    """Result of :func:`beam_step`; all tensors are ``[bsz, ...]`` on the input's device."""

    cand_scores: Tensor  # [bsz, cands] cumulative scores of the candidates, best first
    cand_tokens: Tensor  # [bsz, cands] token of each candidate
    cand_beams: Tensor  # [bsz, cands] input hypothesis (0 <= . < in_beam) each extends
    finalize: Tensor  # [bsz, beam] bool: candidate j < beam ends in EOS with a finite score
    alive_beams: Tensor  # [bsz, beam] back-pointers of the next beam into the input beam
    alive_tokens: Tensor  # [bsz, beam] newest token of each next hypothesis
    alive_scores: Tensor  # [bsz, beam] cumulative score of each next hypothesis


def beam_step(lprobs: Tensor, scores: Tensor, beam_size: int, eos: int) -> BeamStep:
    """Expand ``in_beam`` hypotheses per sentence by one token.

    Args:
        lprobs: ``[bsz, in_beam, vocab]`` log-probabilities of the next token for each
            hypothesis, already masked (pad, min/max length, ...). At the first step the caller
            passes ``in_beam == 1``, because all hypotheses of a sentence are still identical.
        scores: ``[bsz, in_beam]`` cumulative scores of the hypotheses so far.
        beam_size: hypotheses kept per sentence.
        eos: end-of-sentence token.
    """
    bsz, in_beam, vocab = lprobs.shape
    total = lprobs + scores.unsqueeze(2)
    # Same k as fairseq: ties are then broken identically by torch.topk.
    k = min(2 * beam_size, in_beam * vocab - 1)
    cand_scores, flat = torch.topk(total.view(bsz, -1), k)
    cand_beams = torch.div(flat, vocab, rounding_mode="floor")
    cand_tokens = flat.remainder(vocab)
    # An EOS with score -inf (masked EOS) is an ordinary dead candidate, as in fairseq.
    is_eos = cand_tokens.eq(eos) & cand_scores.ne(-math.inf)
    # Stable sort moves the non-EOS candidates first while keeping their rank order.
    sorted_eos, order = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True)
    order = order[:, :beam_size]
    alive_scores = cand_scores.gather(1, order)
    # Only a tiny vocabulary leaves fewer than beam non-EOS candidates: those slots are dead.
    alive_scores.masked_fill_(sorted_eos[:, :beam_size].bool(), -math.inf)
    return BeamStep(
        cand_scores=cand_scores,
        cand_tokens=cand_tokens,
        cand_beams=cand_beams,
        finalize=is_eos[:, :beam_size],
        alive_beams=cand_beams.gather(1, order),
        alive_tokens=cand_tokens.gather(1, order),
        alive_scores=alive_scores,
    )


def length_normaliser(length: int, alpha: float, style: str) -> float:
    """Divisor of a finished hypothesis' summed log-prob; ``length`` counts tokens incl. EOS.

    ``fairseq``: ``length ** alpha``; ``gnmt``: ``((5 + length) / 6) ** alpha`` (Wu et al. 2016).
    """
    if style == "gnmt":
        return ((5 + length) / 6) ** alpha
    return length**alpha


def block_repeated_ngrams(tokens: Tensor, lprobs: Tensor, ngram_size: int) -> Tensor:
    """Set to -inf, in place, every next token that would repeat an n-gram of ``tokens``.

    ``tokens`` is ``[rows, len]`` (each hypothesis so far, BOS included, no padding) and
    ``lprobs`` ``[rows, vocab]``. Vectorised, so CPU and CUDA block the same n-grams
    (fairseq's CPU fallback compares the padded tail of its buffer and blocks nothing).
    """
    context = ngram_size - 1
    length = tokens.size(1)
    if length < max(ngram_size, 2):
        return lprobs
    if context == 0:  # unigrams: no generated token (BOS excluded) may come again
        return lprobs.scatter_(1, tokens[:, 1:], -math.inf)
    windows = tokens.unfold(1, context, 1)  # [rows, length - context + 1, context]
    # Earlier windows that have a follower, compared with the current last context.
    matches = windows[:, :-1].eq(windows[:, -1:]).all(dim=2)
    followers = tokens[:, context:]
    penalty = torch.zeros_like(followers, dtype=lprobs.dtype).masked_fill_(matches, -math.inf)
    return lprobs.scatter_add_(1, followers, penalty)

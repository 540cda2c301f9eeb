"""One step of batched beam search as pure tensor code (no model, no host synchronisation).

Conventions follow fairseq's ``BeamSearch`` + ``SequenceGenerator`` so that outputs are identical:
one ``torch.topk`` over ``beam x vocab`` takes ``2 x beam`` candidates (so that at least ``beam``
of them do not end in EOS), an EOS candidate finishes a hypothesis only when it ranks inside the
top ``beam`` slots, and the next beam is made of the first ``beam`` non-EOS candidates in rank
order.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.kernels import candidates


class BeamStep(NamedTuple):
    """Result of :func:`beam_step`; all tensors are ``[bsz, ...]`` on the input's device."""

    cand_scores: Tensor  # [bsz, cands] cumulative scores of the candidates, best first
    cand_tokens: Tensor  # [bsz, cands] token of each candidate
    cand_beams: Tensor  # [bsz, cands] input hypothesis (0 <= . < in_beam) each extends
    finalize: Tensor  # [bsz, beam] bool: candidate j < beam ends in EOS with a finite score
    alive_beams: Tensor  # [bsz, beam] back-pointers of the next beam into the input beam
    alive_tokens: Tensor  # [bsz, beam] newest token of each next hypothesis
    alive_scores: Tensor  # [bsz, beam] cumulative score of each next hypothesis
    # [bsz, 1] bool: the best candidate's score is NaN (torch.topk ranks NaN first: some
    # log-prob was NaN); None where none can be (our kernel leaves any NaN to torch.topk)
    first_nan: Tensor | None = None


def candidates_per_row(beam_size: int, hypotheses: int, vocab: int) -> int:
    """fairseq's k: the 2 x beam best of a sentence's ``hypotheses`` x ``vocab`` scores, or all
    but one (pad is never a candidate)."""
    return min(2 * beam_size, hypotheses * vocab - 1)


def beam_step(
    lprobs: Tensor, scores: Tensor, beam_size: int, eos: int, last_step: Tensor | None = None
) -> BeamStep:
    """Expand ``in_beam`` hypotheses per sentence by one token.

    Args:
        lprobs: ``[bsz, in_beam, vocab]`` log-probabilities of the next token for each
            hypothesis, already masked (pad, min/max length, ...). At the first step the caller
            passes ``in_beam == 1``, because all hypotheses of a sentence are still identical.
        scores: ``[bsz, in_beam]`` cumulative scores of the hypotheses so far.
        beam_size: hypotheses kept per sentence.
        eos: end-of-sentence token.
        last_step: ``[bsz]`` bool, the sentences at their maximum length (None: none), whose
            dead candidates (score -inf) may be any: nothing follows them.
    """
    bsz, in_beam, vocab = lprobs.shape
    k = candidates_per_row(beam_size, in_beam, vocab)
    if k >= beam_size and candidates.serves(lprobs):  # our kernel, where ties do not decide
        made, unsure = candidates.beam_step(lprobs, scores, k, beam_size, eos, last_step)
        if unsure is None:
            return BeamStep(*made)
        # equal scores or NaN: those sentences in torch's order, which fairseq's results follow
        ranked = candidates.torch_top_candidates(
            lprobs.index_select(0, unsure), scores.index_select(0, unsure), k
        )
        theirs = _step_of(*ranked, in_beam, vocab, beam_size, eos)
        return with_rows(BeamStep(*made), unsure, theirs)
    return _step_of(*top_candidates(lprobs, scores, k), in_beam, vocab, beam_size, eos)


def _step_of(
    cand_scores: Tensor, flat: Tensor, in_beam: int, vocab: int, beam_size: int, eos: int
) -> BeamStep:
    """fairseq's beam step on ranked candidates (scores and flat indices ``beam x vocab +
    token``, best first)."""
    k = cand_scores.size(1)
    cand_beams = torch.div(flat, vocab, rounding_mode="floor")
    cand_tokens = flat.remainder(vocab)
    # An EOS with score -inf (masked EOS) is an ordinary dead candidate, as in fairseq.
    is_eos = cand_tokens.eq(eos) & cand_scores.ne(-math.inf)
    # Stable sort moves the non-EOS candidates first while keeping their rank order.
    sorted_eos, order = torch.sort(is_eos, dim=1, stable=True)
    order = order[:, :beam_size]
    alive_scores = cand_scores.gather(1, order)
    if k - in_beam < beam_size:
        # Fewer than beam non-EOS candidates are possible (tiny vocabulary): such slots are dead.
        alive_scores.masked_fill_(sorted_eos[:, :beam_size], -math.inf)
    return BeamStep(
        cand_scores=cand_scores,
        cand_tokens=cand_tokens,
        cand_beams=cand_beams,
        finalize=is_eos[:, :beam_size],
        alive_beams=cand_beams.gather(1, order),
        alive_tokens=cand_tokens.gather(1, order),
        alive_scores=alive_scores,
        first_nan=cand_scores[:, :1].isnan(),
    )


def with_rows(res: BeamStep, index: Tensor | list[int], rows: BeamStep) -> BeamStep:
    """``res`` with its rows ``index`` replaced by those of ``rows`` (as wide)."""
    at = torch.as_tensor(index, device=res.cand_scores.device)
    replaced = {
        name: getattr(res, name).index_copy(0, at, getattr(rows, name))
        for name in BeamStep._fields[:-1]
    }
    if res.first_nan is not None or rows.first_nan is not None:  # a NaN: stepped again
        whole, part = (
            step.first_nan if step.first_nan is not None
            else torch.zeros((step.cand_scores.size(0), 1), dtype=torch.bool, device=at.device)
            for step in (res, rows)
        )  # fmt: skip
        replaced["first_nan"] = whole.index_copy(0, at, part)
    return res._replace(**replaced)


def concat_steps(first: BeamStep, second: BeamStep) -> BeamStep:
    """Two groups' steps as one, sentences of ``first`` first. A group whose hypotheses all
    came from one row may have fewer candidates (a vocabulary under 2 x beam words): its extra
    ones are dead (score -inf)."""
    k = max(first.cand_scores.size(1), second.cand_scores.size(1))

    def widened(step: BeamStep) -> BeamStep:
        missing = k - step.cand_scores.size(1)
        if not missing:
            return step
        return step._replace(
            cand_scores=F.pad(step.cand_scores, (0, missing), value=-math.inf),
            cand_tokens=F.pad(step.cand_tokens, (0, missing)),
            cand_beams=F.pad(step.cand_beams, (0, missing)),
        )

    def nan_column(step: BeamStep) -> Tensor:
        if step.first_nan is not None:
            return step.first_nan
        return torch.zeros((step.cand_scores.size(0), 1), dtype=torch.bool,
                           device=step.cand_scores.device)  # fmt: skip

    first, second = widened(first), widened(second)
    joined = {
        name: torch.cat([getattr(first, name), getattr(second, name)])
        for name in BeamStep._fields
        if name != "first_nan"
    }
    if first.first_nan is not None or second.first_nan is not None:
        joined["first_nan"] = torch.cat([nan_column(first), nan_column(second)])
    return BeamStep(**joined)


def step_laid_out(
    lprobs: Tensor, scores: Tensor, multi: int, one_row: int, beam_size: int, eos: int,
    last_step: Tensor | None = None,
) -> BeamStep:  # fmt: skip
    """The beam step of sentences laid out sentence-major: first ``multi`` sentences with
    ``beam_size`` rows each (``scores`` ``[multi, hypotheses]``: at a batch's first step one
    hypothesis each, read from their first row), then ``one_row`` sentences with one row each
    (their first step, score 0); ``last_step`` as :func:`beam_step`'s, of them all."""
    steps = []
    if multi:
        rows = lprobs if not one_row else lprobs[: multi * beam_size]
        rows = rows.view(multi, beam_size, -1)
        if scores.size(1) < beam_size:  # a batch's first step: one hypothesis each
            rows = rows[:, : scores.size(1)]
        last = None if last_step is None else last_step[:multi]
        steps.append(beam_step(rows, scores, beam_size, eos, last))
    if one_row:
        first = lprobs[multi * beam_size :].unsqueeze(1)
        last = None if last_step is None else last_step[multi:]
        steps.append(beam_step(first, first.new_zeros(one_row, 1), beam_size, eos, last))
    return steps[0] if len(steps) == 1 else concat_steps(*steps)


# Below this many log-probs per step a plain torch.topk is as fast as the chunked one.
CHUNKED_TOPK_MIN_SIZE = 1 << 15


@functools.cache  # called every step with the same few arguments
def chunk_size(vocab: int, chunks_needed: int) -> int | None:
    """The chunk width for :func:`top_candidates`: a divisor of ``vocab`` in 64..256 that cuts
    it into at least ``chunks_needed`` chunks, preferably a multiple of 8, nearest to 128.

    Widths of 100-200 were fastest (docs/speed.md): narrower chunks make the maxima slow (short
    reductions), wider ones the second top-k, and widths that are not a multiple of 8 (or 4)
    vectorise worse.
    """
    sizes = [d for d in range(64, 257) if vocab % d == 0 and vocab // d >= chunks_needed]
    for multiple in (8, 4, 1):
        aligned = [d for d in sizes if d % multiple == 0]
        if aligned:
            return min(aligned, key=lambda d: abs(math.log(d / 128)))
    return None


def top_candidates(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk`` of ``lprobs + scores`` over ``in_beam x vocab`` per sentence.

    Returns the candidates' scores and flat indices (``beam * vocab + token``), best first.
    On the CPU in float32 our kernel finds them in one pass (beamplugin.kernels.candidates).
    Elsewhere, for large inputs the sum is not materialised: each hypothesis' vocabulary is cut into
    chunks, and since the k best candidates lie in the k chunks with the best maxima, only
    those chunks are summed and searched. Scores and candidates are the same as a full
    ``torch.topk`` (same float additions); only the order among exactly equal scores, which
    torch.topk leaves unspecified too, may differ.
    """
    if candidates.serves(lprobs):
        return candidates.top_candidates(lprobs, scores, k)
    bsz, in_beam, vocab = lprobs.shape
    chunks_needed = -(-k // in_beam)  # the top-k needs k chunks in all
    chunk = chunk_size(vocab, chunks_needed) if lprobs.numel() >= CHUNKED_TOPK_MIN_SIZE else None
    if chunk is None:
        return torch.topk((lprobs + scores.unsqueeze(2)).view(bsz, -1), k)
    per_beam = vocab // chunk
    chunks = lprobs.reshape(-1, chunk)  # [bsz * in_beam * per_beam, chunk]
    # fl(max + s) == max(fl(x + s)): rounding is monotone, so these are the chunks' best totals
    chunk_best = chunks.amax(1).view(bsz, in_beam, per_beam).add_(scores.unsqueeze(2))
    best_chunks = torch.topk(chunk_best.view(bsz, -1), k).indices  # best first
    # index_select of whole rows: faster than a gather of an expanded index (docs/speed.md)
    first_chunk = torch.arange(0, chunks.size(0), in_beam * per_beam, device=lprobs.device)
    picked = chunks.index_select(0, (best_chunks + first_chunk.unsqueeze(1)).view(-1))
    beams = torch.div(best_chunks, per_beam, rounding_mode="floor")
    picked = picked.view(bsz, k, chunk).add_(scores.gather(1, beams).unsqueeze(2))
    cand_scores, position = torch.topk(picked.view(bsz, -1), k)
    chunk_of = best_chunks.gather(1, torch.div(position, chunk, rounding_mode="floor"))
    return cand_scores, chunk_of * chunk + position.remainder(chunk)


def length_normaliser(length: int, alpha: float, style: str) -> float:
    """Divisor of a finished hypothesis' summed log-prob; ``length`` counts tokens incl. EOS.

    ``fairseq``: ``length ** alpha``; ``gnmt``: ``((5 + length) / 6) ** alpha`` (Wu et al. 2016).
    """
    if style == "gnmt":
        return ((5 + length) / 6) ** alpha
    return length**alpha


def block_repeated_ngrams(tokens: Tensor, lprobs: Tensor, ngram_size: int, pad: int) -> Tensor:
    """Set to -inf, in place, every next token that would repeat an n-gram of ``tokens``.

    ``tokens`` is ``[rows, len]``: each hypothesis so far, BOS included, left-padded with
    ``pad`` where hypotheses of different lengths share the tensor. ``lprobs`` is
    ``[rows, vocab]``. Vectorised, so CPU and CUDA block the same n-grams (fairseq's CPU
    fallback compares the padded tail of its buffer and blocks nothing). Padding never matches:
    a window that holds padding is followed by the row's BOS, which occurs once per row.
    """
    context = ngram_size - 1
    length = tokens.size(1)
    if length < max(ngram_size, 2):
        return lprobs
    if context == 0:  # unigrams: no generated token (BOS excluded) may come again
        generated = tokens.ne(pad).cumsum(1).gt(1)  # after the padding and BOS
        penalty = torch.zeros_like(tokens, dtype=lprobs.dtype).masked_fill_(generated, -math.inf)
        return lprobs.scatter_add_(1, tokens, penalty)
    windows = tokens.unfold(1, context, 1)  # [rows, length - context + 1, context]
    # Earlier windows that have a follower, compared with the current last context.
    matches = windows[:, :-1].eq(windows[:, -1:]).all(dim=2)
    followers = tokens[:, context:]
    penalty = torch.zeros_like(followers, dtype=lprobs.dtype).masked_fill_(matches, -math.inf)
    return lprobs.scatter_add_(1, followers, penalty)

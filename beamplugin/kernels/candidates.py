"""A beam search step's candidates (the k best of each sentence's log-probabilities plus its
hypotheses' scores) on the CPU through our kernel (``native/candidates.c``): one pass, without
materializing the sums, the candidates and scores ``torch.topk`` of the sums gives. Where a
sentence's order is torch's own choice (equal scores, NaN), ``torch.topk`` ranks that sentence
(each sentence's ranking is its own: the others keep the kernel's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from beamplugin.kernels import native_library, trials
from beamplugin.kernels.native_library import INT, POINTER, SIZE, threads_for
from beamplugin.kernels.trials import Trial


@native_library.cached
def _kernel() -> Callable[..., Any] | None:
    argtypes = [POINTER, SIZE, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, POINTER, POINTER, POINTER]
    return native_library.function("candidates", "top_candidates", [*argtypes, INT], SIZE)


@native_library.cached
def _step_kernel() -> Callable[..., Any] | None:
    argtypes = [POINTER, SIZE, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE]
    argtypes += [POINTER] * 9 + [INT]
    return native_library.function("candidates", "beam_step", argtypes, SIZE)


def serves(lprobs: Tensor) -> bool:
    """Whether ``lprobs``' candidates are found here: float32 on the CPU, kernel built, and
    faster than torch's add and topk at its beams and vocabulary (beamplugin.kernels.trials;
    the candidates are the same either way)."""
    if lprobs.dtype != torch.float32 or not lprobs.is_cpu or _kernel() is None:
        return False
    shape = tuple(lprobs.shape[1:])
    return trials.ours_is_faster("candidates", shape, lambda: trial(*shape))


def trial(beams: int, vocab: int) -> Trial:
    """Our candidates against torch's add and topk, for one sentence and for 16."""
    inputs = []
    for sentences in (1, 16):
        lprobs = torch.randn(sentences, beams, vocab).log_softmax(-1)
        inputs.append((lprobs, torch.randn(sentences, beams), min(2 * beams, beams * vocab)))

    def torchs(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return torch.topk((lprobs + scores.unsqueeze(2)).view(lprobs.size(0), -1), k)

    return Trial(top_candidates, torchs, inputs)


# the sums torch ranks at once, at most (a few sentences' at a large vocabulary): below glibc's
# mmap threshold, so the heap serves them again without page faults (beamplugin.runtime.heap)
TORCH_RANKS_BYTES = 16 << 20


def torch_top_candidates(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """What :func:`top_candidates` gives, ranked by ``torch.topk`` (its order among equal scores,
    which fairseq's results follow), a few sentences at a time: each sentence's ranking is its
    own, and 64 sentences' sums over 5 beams of 256k words would be a 328 MB tensor."""
    sentences, beams, vocab = lprobs.shape
    each = max(1, TORCH_RANKS_BYTES // (beams * vocab * lprobs.element_size()))
    parts = [
        torch.topk((lprobs[i : i + each] + scores[i : i + each].unsqueeze(2)).flatten(1), k)
        for i in range(0, sentences, each)
    ]
    if len(parts) == 1:
        return parts[0].values, parts[0].indices
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def top_candidates(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk`` of ``lprobs + scores.unsqueeze(2)`` over each sentence's ``beams x vocab``
    (``lprobs`` ``[sentences, beams, vocab]``, words consecutive; ``scores`` ``[sentences,
    beams]``): the ``k`` best scores and their flat indices ``beam x vocab + word``."""
    kernel = _kernel()
    assert kernel is not None, "check serves() first"
    sentences, beams, vocab = lprobs.shape
    if lprobs.stride(2) != 1 or scores.shape != (sentences, beams) or not 0 < k <= beams * vocab:
        raise ValueError(f"lprobs {tuple(lprobs.shape)}, scores {tuple(scores.shape)}, k {k}")
    if scores.dtype != torch.float32 or not scores.is_cpu:
        raise ValueError(f"scores must be float32 on the CPU, not {scores.dtype}")
    scores = scores.contiguous()
    values = lprobs.new_empty((sentences, k))
    indices = torch.empty((sentences, k), dtype=torch.int64)
    unsure_rows = torch.empty(sentences, dtype=torch.bool)
    unsure = kernel(
        lprobs.data_ptr(),
        lprobs.stride(0),
        lprobs.stride(1),
        scores.data_ptr(),
        sentences,
        beams,
        vocab,
        k,
        values.data_ptr(),
        indices.data_ptr(),
        unsure_rows.data_ptr(),
        threads_for(sentences * beams * vocab // 8),
    )
    if unsure:  # equal scores or NaN: torch's order, which fairseq's results follow
        rows = unsure_rows.nonzero().squeeze(1)
        ranked = torch_top_candidates(lprobs.index_select(0, rows), scores.index_select(0, rows), k)
        values.index_copy_(0, rows, ranked[0])
        indices.index_copy_(0, rows, ranked[1])
    return values, indices


def beam_step(
    lprobs: Tensor, scores: Tensor, k: int, beam_size: int, eos: int,
    last_step: Tensor | None = None,
) -> tuple[tuple[Tensor, ...], Tensor | None]:  # fmt: skip
    """fairseq's beam step on the ``k`` (>= ``beam_size``) best candidates of :func:`top_candidates`
    in one call: candidate scores, tokens and hypotheses ``[sentences, k]``, which of the first
    ``beam_size`` end in EOS (finalize), and the next beam's hypotheses, tokens and scores
    ``[sentences, beam_size]`` (beamplugin.search.beam_step.BeamStep's fields, in its order);
    and the sentences whose equal scores or NaN leave their order to torch.topk (their rows
    of the step not made), or None. In a sentence at its last step (``last_step``, bool
    ``[sentences]``), equal -inf scores leave nothing to torch: those dead candidates never
    finish and have no next step, so which fill its last places changes no result."""
    kernel = _step_kernel()
    assert kernel is not None, "check serves() first"
    sentences, beams, vocab = lprobs.shape
    if lprobs.stride(2) != 1 or scores.shape != (sentences, beams) or not (
        beam_size <= k <= beams * vocab
    ):  # fmt: skip
        raise ValueError(f"lprobs {tuple(lprobs.shape)}, scores {tuple(scores.shape)}, k {k}")
    if scores.dtype != torch.float32 or not scores.is_cpu:
        raise ValueError(f"scores must be float32 on the CPU, not {scores.dtype}")
    scores = scores.contiguous()
    candidates, beam = (sentences, k), (sentences, beam_size)
    outputs = (
        lprobs.new_empty(candidates),  # scores
        torch.empty(candidates, dtype=torch.int64),  # tokens
        torch.empty(candidates, dtype=torch.int64),  # hypotheses
        torch.empty(beam, dtype=torch.bool),  # finalize
        torch.empty(beam, dtype=torch.int64),  # the next beam's hypotheses
        torch.empty(beam, dtype=torch.int64),  # its tokens
        lprobs.new_empty(beam),  # its scores
    )
    if last_step is not None:
        if last_step.shape != (sentences,) or last_step.dtype != torch.bool:
            raise ValueError(f"last_step must be bool [{sentences}], not {last_step.dtype} "
                             f"{tuple(last_step.shape)}")  # fmt: skip
        last_step = last_step.contiguous()
    unsure_rows = torch.empty(sentences, dtype=torch.bool)
    unsure = kernel(
        lprobs.data_ptr(), lprobs.stride(0), lprobs.stride(1), scores.data_ptr(), sentences,
        beams, vocab, k, beam_size, eos, *[t.data_ptr() for t in outputs],
        None if last_step is None else last_step.data_ptr(),
        unsure_rows.data_ptr(), threads_for(sentences * beams * vocab // 8),
    )  # fmt: skip
    return outputs, (unsure_rows.nonzero().squeeze(1) if unsure else None)

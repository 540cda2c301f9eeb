"""The exact stopping rule's bound: the best final score any continuation of a sentence's live
hypotheses can still reach. A sentence whose worst kept hypothesis scores at least that much
can stop: no later hypothesis would enter its n-best."""

from __future__ import annotations

import torch
from torch import Tensor

from beamplugin.runtime.host_transfer import to_device
from beamplugin.search.beam_step import length_normaliser
from beamplugin.search.options import DecodingOptions


def best_possible(
    best_alive: Tensor, steps: list[int], max_lens: list[int], options: DecodingOptions
) -> Tensor:
    """``[sentences]`` upper bound of the final score of any continuation of the live
    hypotheses, from each sentence's best live cumulative score ``best_alive``, its step and
    its maximum output length.

    A live hypothesis after step ``t`` has ``t + 1`` tokens; it can end with a length ``L`` in
    ``[t + 2, max_len + 1]``. Log-probs are <= 0, so its summed score can only drop, except by
    the unk bonus of a negative unk penalty: ``N = best + bonus``. Its normalised score is
    ``S / lp(L)`` with ``S <= N`` and ``lp > 0`` monotone in ``L``, so ``S / lp(L) <= N /
    lp(L)``, which is largest at one end of the length range: ``N / max(lp)`` when ``N <= 0``,
    else ``N / min(lp)``.
    """
    device = best_alive.device
    unk_bonus = max(0.0, -options.unk_penalty)
    if unk_bonus:
        bonus = [unk_bonus * (m - t) for t, m in zip(steps, max_lens, strict=True)]
        best_alive = best_alive + to_device(bonus, device, best_alive.dtype)
    if not options.normalize_scores:
        return best_alive
    alpha, style = options.len_penalty, options.length_penalty_style
    ends = [
        [length_normaliser(t + 2, alpha, style), length_normaliser(m + 1, alpha, style)]
        for t, m in zip(steps, max_lens, strict=True)
    ]
    shortest, longest = to_device(ends, device, best_alive.dtype).unbind(1)
    return torch.where(
        best_alive > 0,
        best_alive / shortest.minimum(longest),
        best_alive / shortest.maximum(longest),
    )

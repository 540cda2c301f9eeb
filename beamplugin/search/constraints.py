"""Lexically constrained beam search: fairseq's ``LexicallyConstrainedBeamSearch`` (Post & Vilar
2018, with Hu et al. 2019's dynamic beam allocation), one sentence at a time, so that a
constrained sentence shares a step with unconstrained ones and gets what it gets alone.

A sentence's constraints are token sequences that every finished hypothesis must contain:
``ordered`` in the order given, ``unordered`` in any order. Each hypothesis carries fairseq's
own state of its progress (``OrderedConstraintState`` / ``UnorderedConstraintState`` of
``fairseq.token_generation_constraints``, reused so that the states, their banks and their
quirks are fairseq's). A step of a constrained sentence takes fairseq's candidates: the 2 x beam
best, each hypothesis' best, and each hypothesis' next constraint tokens; sorts them by bank
(constraint tokens met) and score, strikes duplicates, stripes them round-robin across the
banks and keeps the first 2 x beam. EOS is forbidden to a hypothesis that has not met all its
constraints. Then, as in :func:`beamplugin.search.beam_step.beam_step`, an EOS among the top
beam ends a hypothesis and the first beam other candidates go on.

The cost: like fairseq's, this step is host-side Python per hypothesis and per candidate (a
state object advanced per candidate, small tensor operations and host reads per sentence),
about 0.8 ms per constrained sentence per step at beam 5 on 8k words (one thread); sentences
without constraints in the same step do not pay it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from fairseq.token_generation_constraints import (
    ConstraintState,
    OrderedConstraintState,
    UnorderedConstraintState,
    pack_constraints,
)
from torch import Tensor

from beamplugin.search.beam_step import BeamStep, top_candidates

# A sentence's constraints: token sequences, each of at least one token.
Constraints = list[list[int]]

# fairseq's sort key weight of a bank: (tokens - bank) * MAX_SCORE + score
MAX_SCORE = -100


def initial_state(constraints: Constraints, representation: str) -> ConstraintState:
    """The state of a sentence's first hypothesis, built as fairseq builds it (from the packed
    row, so its tokens are the same objects fairseq's states hold)."""
    packed = pack_constraints([[torch.tensor(c, dtype=torch.long) for c in constraints]])[0]
    if representation == "ordered":
        return OrderedConstraintState.create(packed)
    return UnorderedConstraintState.create(packed)


def check_constraints(
    constraints: Constraints, max_len: int, vocab: int, special: dict[str, int]
) -> None:
    """Raise ValueError if ``constraints`` cannot be decoded: an empty one, a token outside the
    vocabulary or one of the ``special`` tokens (by name), or more tokens in all than ``max_len``
    output tokens can hold."""
    for constraint in constraints:
        if not constraint:
            raise ValueError("an empty constraint (a constraint needs at least one token)")
        for token in constraint:
            if not 0 <= token < vocab:
                raise ValueError(f"constraint token {token} is outside the vocabulary of {vocab}")
            for name, special_token in special.items():
                if token == special_token:
                    raise ValueError(f"a constraint holds the {name} token ({token})")
    total = sum(len(c) for c in constraints)
    if total > max_len:
        raise ValueError(
            f"constraints of {total} tokens in all cannot fit in the maximum output length "
            f"of {max_len} tokens"
        )


class ConstrainedSentence(NamedTuple):
    """A constrained sentence's share of a step."""

    index: int  # its row in the step's BeamStep
    lprobs: Tensor  # [hypotheses, vocab] its log-probs after the rules (1 row at its first step)
    scores: Tensor | None  # [hypotheses] cumulative scores; None at its first step
    states: list[ConstraintState]  # one per hypothesis


def constrained_step(
    res: BeamStep, sentences: list[ConstrainedSentence], beam: int, eos: int
) -> tuple[BeamStep, list[list[ConstraintState]]]:
    """``res`` with the rows of ``sentences`` replaced by their constrained step, and each
    one's states for its next beam."""
    k = res.cand_scores.size(1)
    columns: dict[str, list[Tensor]] = {name: [] for name in BeamStep._fields[:-1]}
    next_states = []
    for sentence in sentences:
        cand_scores, cand_tokens, cand_beams, cand_states = candidates(
            sentence.lprobs, sentence.scores, sentence.states, k, eos
        )
        # as beam_step: an EOS with a finite score ends; the first beam others go on
        is_eos = cand_tokens.eq(eos) & cand_scores.ne(-math.inf)
        order = torch.sort(is_eos, stable=True).indices[:beam]
        for name, value in zip(
            columns,
            (cand_scores, cand_tokens, cand_beams, is_eos[:beam], cand_beams[order],
             cand_tokens[order], cand_scores[order]),
            strict=True,
        ):  # fmt: skip
            columns[name].append(value)
        next_states.append([cand_states[i] for i in order.tolist()])
    index = torch.tensor([s.index for s in sentences], device=res.cand_scores.device)
    replaced = {
        name: getattr(res, name).index_copy(
            0, index, torch.stack(rows).to(getattr(res, name).dtype)
        )
        for name, rows in columns.items()
    }
    if res.first_nan is not None:  # their NaN log-probs were -inf already
        replaced["first_nan"] = res.first_nan.index_fill(0, index, False)
    return res._replace(**replaced), next_states


def candidates(
    lprobs: Tensor, scores: Tensor | None, states: list[ConstraintState], k: int, eos: int
) -> tuple[Tensor, Tensor, Tensor, list[ConstraintState]]:
    """fairseq's ``LexicallyConstrainedBeamSearch.step`` and ``step_sentence`` for one sentence:
    its ``k`` candidates (scores, tokens, hypotheses), best first in fairseq's striped order,
    and the state of every candidate before the cut (fairseq's list, which its next beam
    indexes). The same operations in the same order, so the same ties and quirks (the first
    top-k by beam_step's ``top_candidates``, which gives ``torch.topk``'s)."""
    lprobs = lprobs.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    hypotheses, vocab = lprobs.shape
    first = scores is None
    if not first:  # no EOS before every constraint is met
        unfinished = [beam for beam, state in enumerate(states) if not state.finished]
        if unfinished:
            lprobs[unfinished, eos] = -math.inf
    # fairseq's torch.topk of the cumulative scores (our kernel where it serves: the same)
    history = lprobs.new_zeros(1, 1) if first else scores.view(1, -1)
    scores_buf, indices_buf = top_candidates(lprobs.unsqueeze(0), history, k)
    if not first:
        lprobs = lprobs + scores.unsqueeze(-1)
    beams_buf = indices_buf // vocab
    indices_buf = indices_buf.fmod(vocab)
    if not first:  # each hypothesis' best
        top_scores, top_indices = torch.topk(lprobs, k=1, dim=1)
        scores_buf = torch.cat((scores_buf, top_scores.view(1, -1)), dim=1)
        indices_buf = torch.cat((indices_buf, top_indices.view(1, -1)), dim=1)
        beams_buf = torch.cat((beams_buf, torch.arange(0, hypotheses).repeat(1, 1)), dim=1)
    scores_buf, indices_buf, beams_buf = scores_buf[0], indices_buf[0], beams_buf[0]

    # each hypothesis' next constraint tokens (at the first step: the one hypothesis'), in
    # fairseq's order, appended at once
    reached = states[:1] if first else states
    next_tokens, next_beams = [], []
    for beam, state in enumerate(reached):
        tokens = list(state.next_tokens())
        next_tokens += tokens
        next_beams += [beam] * len(tokens)
    if next_tokens:
        tokens, beams = torch.tensor(next_tokens).long(), torch.tensor(next_beams)
        indices_buf = torch.cat((indices_buf, tokens))
        beams_buf = torch.cat((beams_buf, beams))
        scores_buf = torch.cat((scores_buf, lprobs[beams, tokens]))

    # sort by (bank, score), as fairseq does: bank weighs MAX_SCORE a token
    cand_states = [
        states[beam].advance(token)
        for beam, token in zip(beams_buf.tolist(), indices_buf.tolist(), strict=True)
    ]
    banks = torch.tensor([s.bank for s in cand_states])
    constraint_tokens = len(reached[-1].tokens)  # fairseq reads its loop's last state
    sort_key = (constraint_tokens - banks) * MAX_SCORE + scores_buf
    sort_indices = sort_key.sort(dim=0, descending=True).indices
    scores_buf, indices_buf = scores_buf[sort_indices], indices_buf[sort_indices]
    beams_buf, banks = beams_buf[sort_indices], banks[sort_indices]
    cand_states = [cand_states[i] for i in sort_indices.tolist()]

    # strike a candidate equal to the one before it (fairseq compares the first with the last
    # too, and then drops a state only for the others)
    keys = beams_buf * (vocab + 1) + indices_buf
    unique = torch.cat((keys[-1:], keys[:-1])) != keys
    scores_buf, indices_buf = scores_buf[unique], indices_buf[unique]
    beams_buf, banks = beams_buf[unique], banks[unique]
    position = 1
    for keep in unique[1:].tolist():
        if not keep:
            cand_states.pop(position)
        position += keep

    # stripes: the best of each bank (highest first), then the second of each, ...
    count = len(banks)
    stripes = []
    bank_rank, current = -1, None
    for bank in banks.tolist():
        if current is None:
            current = bank
        if bank != current:
            bank_rank, current = 0, bank
        else:
            bank_rank += 1
        stripes.append(constraint_tokens - bank + bank_rank * (count + 1))
    sort_indices = torch.tensor(stripes, dtype=banks.dtype).sort(dim=0).indices
    scores_buf, indices_buf = scores_buf[sort_indices], indices_buf[sort_indices]
    beams_buf = beams_buf[sort_indices]
    cand_states = [cand_states[i] for i in sort_indices.tolist()]
    return scores_buf[:k], indices_buf[:k], beams_buf[:k], cand_states

"""Lexically constrained beam search: fairseq's ``LexicallyConstrainedBeamSearch`` (Post & Vilar
2018, with Hu et al. 2019's dynamic beam allocation) for every constrained sentence of a step at
once, so that a constrained sentence shares a step with unconstrained ones and gets what it gets
alone.

A sentence's constraints are token sequences that every finished hypothesis must contain:
``ordered`` in the order given, ``unordered`` in any order. Each hypothesis' progress through
them is a state number of the sentence's :class:`ConstraintStates` (fairseq's states and moves).
A step of a constrained sentence takes fairseq's candidates: the 2 x beam best, each
hypothesis' best, and each hypothesis' next constraint tokens; sorts them by bank (constraint
tokens met) and score, strikes duplicates, stripes them round-robin across the banks and keeps
the first 2 x beam. EOS is forbidden to a hypothesis that has not met all its constraints. Then,
as in :func:`beamplugin.search.beam_step.beam_step`, an EOS among the top beam ends a hypothesis
and the first beam other candidates go on.

The cost, a fixed part of every step that has constrained sentences: a handful of tensor
operations for all of them together (EOS masked, the two top-k calls, one take of the constraint
tokens' log-probs, the results made tensors), and on the host plain Python on each sentence's
few dozen candidates (a state lookup each, fairseq's float32 sort keys, the duplicates, the
stripes, both sorts). A list with equal keys is sorted by ``torch.sort``, as fairseq sorts it,
so that ties fall as in fairseq.
"""

from __future__ import annotations

import math
from array import array
from itertools import compress
from operator import add, ne
from typing import NamedTuple

import torch
from torch import Tensor

from beamplugin.search.beam_step import BeamStep, top_candidates
from beamplugin.search.constraint_states import ROOT, Constraints, ConstraintStates

# fairseq's sort key weight of a bank: (tokens - bank) * MAX_SCORE + score
MAX_SCORE = -100


class Progress(NamedTuple):
    """A sentence's constraint states and each of its hypotheses' state."""

    states: ConstraintStates
    hypotheses: list[int]  # one state per hypothesis (one at the sentence's first step)


def initial_progress(constraints: Constraints, representation: str) -> Progress:
    """A sentence's progress before its first step (``representation``: ordered or unordered)."""
    return Progress(ConstraintStates(constraints, representation), [ROOT])


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
    progress: Progress


class _Candidates(NamedTuple):
    """One sentence's candidates in fairseq's order before the sort, on the host."""

    beams: list[int]
    tokens: list[int]
    scores: list[float]  # cumulative, as the tensors' additions round them


class _Chosen(NamedTuple):
    """One sentence's step on the host: its BeamStep row's integer fields (cand_tokens,
    cand_beams, finalize, alive_beams, alive_tokens) and float fields (cand_scores,
    alive_scores), whether a candidate's score is NaN, and its next beam's states."""

    integers: tuple[list[int], ...]
    floats: tuple[list[float], ...]
    nan: bool
    states: list[int]


def constrained_step(
    sentences: list[ConstrainedSentence], k: int, beam: int, eos: int
) -> tuple[BeamStep, list[Progress]]:
    """The constrained step of ``sentences``: a BeamStep of ``k`` candidates a row, a row each
    in their order (``first_nan`` None where no candidate's score is NaN), and each one's
    progress for its next beam. EOS is masked in place in their log-probs for the hypotheses
    that have not met all their constraints, as fairseq's search masks its own."""
    chosen: list[_Chosen | None] = [None] * len(sentences)
    device = sentences[0].lprobs.device
    # sentences at their first step (one hypothesis each) and the others: a top-k each
    for first in (True, False):
        group = [i for i, s in enumerate(sentences) if (s.scores is None) == first]
        if not group:
            continue
        members = [sentences[i] for i in group]
        lists, dtype = _candidates(members, k, eos)
        for i, sentence, candidates in zip(group, members, lists, strict=True):
            chosen[i] = _choose(sentence.progress, candidates, k, beam, eos, (dtype, device))
    done = [c for c in chosen if c is not None]
    # every column of every sentence in two transfers, field after field, so that each field
    # is a contiguous [sentences, width] tensor as beam_step's are
    integers = _tensor([x for field in zip(*(c.integers for c in done), strict=True)
                        for row in field for x in row], torch.int64, device)  # fmt: skip
    floats = _tensor([x for field in zip(*(c.floats for c in done), strict=True)
                      for row in field for x in row], dtype, device)  # fmt: skip
    count = len(done)
    cand_tokens, cand_beams, finalize, alive_beams, alive_tokens, cand_scores, alive_scores = (
        part.view(count, -1)
        for part in (*integers.split_with_sizes([count * w for w in (k, k, beam, beam, beam)]),
                     *floats.split_with_sizes([count * k, count * beam]))
    )  # fmt: skip
    nan = [c.nan for c in done]
    step = BeamStep(
        cand_scores, cand_tokens, cand_beams, finalize.bool(), alive_beams, alive_tokens,
        alive_scores, torch.tensor(nan, device=device).view(-1, 1) if any(nan) else None,
    )  # fmt: skip
    progress = [Progress(s.progress.states, c.states) for s, c in zip(sentences, done, strict=True)]
    return step, progress


def _candidates(
    group: list[ConstrainedSentence], k: int, eos: int
) -> tuple[list[_Candidates], torch.dtype]:
    """fairseq's candidates of each sentence of ``group`` (all at their first step or none),
    before its sort: the ``k`` best (beam_step's ``top_candidates``: torch.topk's), each
    hypothesis' best, each hypothesis' next constraint tokens, in that order; and the dtype of
    their scores. One transfer a tensor to the host, the rest is plain Python."""
    first = group[0].scores is None
    lprobs = _rows(group)
    count, hypotheses, vocab = lprobs.shape
    if first:
        history = lprobs.new_zeros(count, 1)
    else:
        history = group[0].scores.view(1, -1) if count == 1 else torch.stack(
            [s.scores for s in group])  # fmt: skip
        _forbid_eos(group, lprobs, eos)
    scores, flat = top_candidates(lprobs, history, k)
    dtype = scores.dtype
    lists = [
        _Candidates([f // vocab for f in row_flat], [f % vocab for f in row_flat], row_scores)
        for row_flat, row_scores in zip(flat.tolist(), scores.tolist(), strict=True)
    ]
    if not first:  # each hypothesis' best
        for c, (best_scores, best_tokens) in zip(lists, _best_each(lprobs, history), strict=True):
            c.beams.extend(range(hypotheses))
            c.tokens.extend(best_tokens)
            c.scores.extend(best_scores)
    # the next constraint tokens: their log-probs in one take, their hypotheses' scores added
    # as the tensors' addition rounds them (fairseq takes them from lprobs + scores)
    sources, hypothesis_scores = [], []
    history_rows = None if first else history.tolist()
    for row, (sentence, c) in enumerate(zip(group, lists, strict=True)):
        states, hypothesis_states = sentence.progress
        for hypothesis, state in enumerate(hypothesis_states):
            for token in states.next_tokens[state]:
                sources.append((row * hypotheses + hypothesis) * vocab + token)
                if history_rows is not None:
                    hypothesis_scores.append(history_rows[row][hypothesis])
                c.beams.append(hypothesis)
                c.tokens.append(token)
    if sources:
        values = lprobs.reshape(-1).take(_tensor(sources, torch.int64, lprobs.device)).tolist()
        if history_rows is not None:
            values = _sums(values, hypothesis_scores, dtype)
        taken = iter(values)
        for c in lists:
            c.scores.extend(next(taken) for _ in range(len(c.tokens) - len(c.scores)))
    return lists, dtype


def _rows(group: list[ConstrainedSentence]) -> Tensor:
    """The log-probs of ``group`` ``[sentences, hypotheses, vocab]``: a view of the caller's
    tensor where their rows follow each other there (a batch all constrained), else a copy."""
    rows = [s.lprobs for s in group]
    hypotheses, vocab = rows[0].shape
    if len(rows) == 1:
        return rows[0].unsqueeze(0)
    size = hypotheses * vocab * rows[0].element_size()
    start = rows[0].data_ptr()
    if all(r.is_contiguous() and r.data_ptr() == start + i * size for i, r in enumerate(rows)):
        return rows[0].as_strided((len(rows), hypotheses, vocab), (hypotheses * vocab, vocab, 1))
    return torch.stack(rows)


def _forbid_eos(group: list[ConstrainedSentence], lprobs: Tensor, eos: int) -> None:
    """No EOS for a hypothesis that has not met all its constraints: -inf in ``lprobs``."""
    hypotheses, vocab = lprobs.shape[1:]
    unfinished = [
        (row * hypotheses + hypothesis) * vocab + eos
        for row, sentence in enumerate(group)
        for hypothesis, state in enumerate(sentence.progress.hypotheses)
        if not sentence.progress.states.finished[state]
    ]  # fmt: skip
    if unfinished:
        lprobs.view(-1).index_fill_(0, _tensor(unfinished, torch.int64, lprobs.device), -math.inf)


def _best_each(lprobs: Tensor, history: Tensor) -> list[tuple[list[float], list[int]]]:
    """fairseq's ``torch.topk(lprobs + history, k=1)`` of each hypothesis, per sentence its
    scores and tokens: the two best of each by ``top_candidates`` (our kernel on the CPU,
    without the sum written out), torch.topk itself for the rows whose two best are equal,
    where its order decides."""
    count, hypotheses, vocab = lprobs.shape
    rows = lprobs.reshape(count * hypotheses, 1, vocab)
    two_scores, two_tokens = top_candidates(rows, history.reshape(-1, 1), 2)
    pairs = two_scores.tolist()
    best_scores = [pair[0] for pair in pairs]
    best_tokens = [pair[0] for pair in two_tokens.tolist()]
    tied = [i for i, (one, two) in enumerate(pairs) if one == two]
    if tied:
        at = torch.tensor(tied, device=lprobs.device)
        again = rows.index_select(0, at).view(-1, vocab) + history.reshape(-1, 1)[at]
        tied_scores, tied_tokens = torch.topk(again, k=1, dim=1)
        for i, score, token in zip(tied, tied_scores.view(-1).tolist(),
                                   tied_tokens.view(-1).tolist(), strict=True):  # fmt: skip
            best_scores[i], best_tokens[i] = score, token
    return [
        (best_scores[r : r + hypotheses], best_tokens[r : r + hypotheses])
        for r in range(0, count * hypotheses, hypotheses)
    ]


def _choose(
    progress: Progress,
    candidates: _Candidates,
    k: int,
    beam: int,
    eos: int,
    scores_on: tuple[torch.dtype, torch.device],
) -> _Chosen:
    """fairseq's ``step_sentence`` after its candidates: sort by (bank, score), strike
    duplicates, sort by stripes; then beam_step's choice, on the host (``scores_on``: the
    scores' dtype and device, where fairseq's sorts run)."""
    dtype, device = scores_on
    states, hypothesis_states = progress
    beams, tokens, scores = candidates
    # (map and the lists' own methods: this runs for every candidate of every step)
    reached = list(map(states.advance, map(hypothesis_states.__getitem__, beams), tokens))
    banks = list(map(states.bank.__getitem__, reached))
    # the sort by bank and score: fairseq's keys, rounded as its tensors round them
    weight = states.sort_tokens
    keys = _sums([(weight - b) * MAX_SCORE for b in banks], scores, dtype)
    items = list(zip(beams, tokens, strict=True))
    order = _order(keys, True, (dtype, device), items)
    # duplicates struck (fairseq compares the first with the last too, and then keeps the
    # first's state in its list of states all the same), then stripes: the best of each bank
    # (highest first), then the second of each, ...
    pairs = list(map(items.__getitem__, order))
    unique = list(map(ne, pairs, pairs[-1:] + pairs[:-1]))
    kept = list(compress(order, unique))
    state_list = kept if unique[0] else [order[0], *kept]
    stripes, rank, current, offset = [], -1, banks[kept[0]], len(kept) + 1
    for bank in map(banks.__getitem__, kept):
        if bank != current:
            rank, current = 0, bank
        else:
            rank += 1
        stripes.append(weight - bank + rank * offset)
    striped = _order(stripes, False, (torch.int64, device))
    # as beam_step: an EOS with a finite score ends; the first beam others go on
    picked = list(map(kept.__getitem__, striped[:k]))
    ending = [tokens[j] == eos and scores[j] != -math.inf for j in picked]
    goes_on = sorted(range(len(ending)), key=ending.__getitem__)[:beam]  # stable: EOS last
    alive = list(map(picked.__getitem__, goes_on))
    return _Chosen(
        (list(map(tokens.__getitem__, picked)), list(map(beams.__getitem__, picked)),
         ending[:beam], list(map(beams.__getitem__, alive)), list(map(tokens.__getitem__, alive))),
        (list(map(scores.__getitem__, picked)), list(map(scores.__getitem__, alive))),
        any(map(math.isnan, scores)),
        [reached[state_list[striped[i]]] for i in goes_on],
    )  # fmt: skip


# the typecodes of Python's array for the dtypes it holds
_ARRAY_TYPES = {torch.int64: "q", torch.float32: "f", torch.float64: "d"}


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` (not empty) as a tensor: through an array's buffer where one holds ``dtype``,
    a few times faster than torch.tensor's conversion of a list."""
    typecode = _ARRAY_TYPES.get(dtype)
    if typecode is None:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.frombuffer(array(typecode, values), dtype=dtype).to(device)


def _sums(first: list[float], second: list[float], dtype: torch.dtype) -> list[float]:
    """``first + second`` as a tensor addition in ``dtype`` rounds it (both numbers that
    ``dtype`` holds). A float32 sum is Python's double sum rounded to float32 (a double holds
    more than twice float32's digits, so rounding twice gives what rounding once does)."""
    if dtype == torch.float32:
        return array("f", map(add, first, second)).tolist()
    if dtype == torch.float64:
        return list(map(add, first, second))
    return (torch.tensor(first, dtype=dtype) + torch.tensor(second, dtype=dtype)).tolist()


def _order(
    values: list,
    descending: bool,
    sorted_on: tuple[torch.dtype, torch.device],
    items: list | None = None,
) -> list[int]:
    """The order fairseq's ``torch.sort`` gives ``values`` (as a tensor ``sorted_on``: dtype and
    device). Where the values differ it is theirs, whatever sorts them (Python here, cheaper
    than a tensor operation), and so it is where equal values stand for equal ``items`` (the
    same candidate twice: which comes first changes nothing); else (or with NaN) torch.sort
    decides, as in fairseq."""
    distinct = len(set(values))
    if not any(map(math.isnan, values)) and (
        distinct == len(values)
        or (items is not None and len(set(zip(values, items, strict=True))) == distinct)
    ):  # each value stands for one item
        return sorted(range(len(values)), key=values.__getitem__, reverse=descending)
    dtype, device = sorted_on
    ranked = torch.tensor(values, dtype=dtype, device=device).sort(descending=descending)
    return ranked.indices.tolist()

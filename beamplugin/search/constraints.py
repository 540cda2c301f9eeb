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

The cost: the tensor work (masks, the top-k, the gathers) is done for all constrained
sentences together, a fixed number of operations a step; what is left per sentence is plain
Python on its few dozen candidates (a state lookup each, the duplicates, the stripes, both
sorts). A list with equal keys is sorted by ``torch.sort`` as fairseq sorts it, with the lists
of its length, so that ties fall as in fairseq.
"""

from __future__ import annotations

import math
from collections import defaultdict
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
    """One sentence's candidates in fairseq's order before the sort: (hypothesis, token) and
    the state each leads to; their scores are a row of the group's tensor."""

    beams: list[int]
    tokens: list[int]
    states: list[int]
    banks: list[int]


def constrained_step(
    res: BeamStep, sentences: list[ConstrainedSentence], beam: int, eos: int
) -> tuple[BeamStep, list[Progress]]:
    """``res`` with the rows of ``sentences`` replaced by their constrained step, and each
    one's progress for its next beam. Their log-probs are read in place (EOS masked there while
    this runs, then restored); a NaN among them sets the row's ``first_nan``, as in beam_step."""
    k = res.cand_scores.size(1)
    # sentences at their first step (one hypothesis each) and the others: one tensor each
    groups = [g for g in ([s for s in sentences if s.scores is None],
                          [s for s in sentences if s.scores is not None]) if g]  # fmt: skip
    columns: dict[str, list[Tensor]] = defaultdict(list)
    progress: list[Progress] = []
    for group in groups:
        scores, lists = _candidates(group, k, eos)
        if res.first_nan is not None:  # else beam_step's kernel saw no NaN in any row
            columns["nan"].append(scores.isnan().any(1))
        picked, ending, order, states = _striped(group, scores, lists, k, beam, eos)
        # every integer column of the group in one tensor: candidates' positions, tokens and
        # hypotheses (k each), then the next beam's positions, tokens, hypotheses and which
        # of the first beam end (beam each)
        table = []
        for c, chosen, ends, alive in zip(lists, picked, ending, order, strict=True):
            goes_on = [chosen[i] for i in alive]
            table += chosen + [c.tokens[j] for j in chosen] + [c.beams[j] for j in chosen]
            table += goes_on + [c.tokens[j] for j in goes_on] + [c.beams[j] for j in goes_on]
            table += ends
        table = torch.tensor(table, device=scores.device).view(len(group), -1)
        cand_positions, cand_tokens, cand_beams, alive_positions, alive_tokens, alive_beams, \
            finalize = table.split([k, k, k, beam, beam, beam, beam], dim=1)  # fmt: skip
        for name, value in zip(
            BeamStep._fields[:-1],
            (scores.gather(1, cand_positions), cand_tokens, cand_beams, finalize.bool(),
             alive_beams, alive_tokens, scores.gather(1, alive_positions)),
            strict=True,
        ):  # fmt: skip
            columns[name].append(value)
        progress += [Progress(s.progress.states, own) for s, own in zip(group, states, strict=True)]
    ordered = [s for group in groups for s in group]
    joined = {name: parts[0] if len(parts) == 1 else torch.cat(parts)
              for name, parts in columns.items()}  # fmt: skip
    nan = joined.pop("nan", None)
    index = torch.tensor([s.index for s in ordered], device=res.cand_scores.device)
    replaced = {
        name: getattr(res, name).index_copy(0, index, value.to(getattr(res, name).dtype))
        for name, value in joined.items()
    }
    if nan is not None:  # a NaN log-prob: the caller makes them -inf and steps again
        replaced["first_nan"] = res.first_nan.index_copy(0, index, nan.view(-1, 1))
    by_sentence = {s.index: p for s, p in zip(ordered, progress, strict=True)}
    return res._replace(**replaced), [by_sentence[s.index] for s in sentences]


def _candidates(
    group: list[ConstrainedSentence], k: int, eos: int
) -> tuple[Tensor, list[_Candidates]]:
    """fairseq's candidates of each sentence of ``group`` (all at their first step or none),
    before its sort: the ``k`` best (beam_step's ``top_candidates``: torch.topk's), each
    hypothesis' best, each hypothesis' next constraint tokens, in that order. Their scores
    ``[sentences, longest]`` (a shorter row padded with -inf) and each one's lists."""
    first = group[0].scores is None
    lprobs = _rows(group)
    count, hypotheses, vocab = lprobs.shape
    if first:
        history = lprobs.new_zeros(count, 1)
        return _listed(group, lprobs, history, k)
    # no EOS before every constraint is met: masked in the caller's rows for the while
    unfinished = [
        [not s.progress.states.finished[state] for state in s.progress.hypotheses] for s in group
    ]
    eos_column = lprobs[:, :, eos]
    kept = eos_column.clone()
    eos_column.masked_fill_(torch.tensor(unfinished, device=lprobs.device), -math.inf)
    try:
        return _listed(group, lprobs, torch.stack([s.scores for s in group]), k)
    finally:
        eos_column.copy_(kept)


def _rows(group: list[ConstrainedSentence]) -> Tensor:
    """The log-probs of ``group`` ``[sentences, hypotheses, vocab]``: a view of the caller's
    tensor where their rows follow each other there (a batch all constrained), else a copy."""
    rows = [s.lprobs for s in group]
    hypotheses, vocab = rows[0].shape
    size = hypotheses * vocab * rows[0].element_size()
    start = rows[0].data_ptr()
    if all(r.is_contiguous() and r.data_ptr() == start + i * size for i, r in enumerate(rows)):
        return rows[0].as_strided((len(rows), hypotheses, vocab), (hypotheses * vocab, vocab, 1))
    return torch.stack(rows)


def _listed(
    group: list[ConstrainedSentence], lprobs: Tensor, history: Tensor, k: int
) -> tuple[Tensor, list[_Candidates]]:
    """:func:`_candidates` on ``lprobs`` with EOS masked and the hypotheses' scores
    ``history``."""
    first = group[0].scores is None
    count, hypotheses, vocab = lprobs.shape
    scores, flat = top_candidates(lprobs, history, k)
    beams, tokens = flat // vocab, flat.fmod(vocab)
    if not first:  # each hypothesis' best
        best_scores, best_tokens = _best_each(lprobs, history)
        scores = torch.cat((scores, best_scores), dim=1)
        tokens = torch.cat((tokens, best_tokens), dim=1)
        beams = torch.cat((beams, torch.arange(hypotheses, device=beams.device).expand(count, -1)),
                          dim=1)  # fmt: skip
    lists = []
    width = scores.size(1)
    # the next constraint tokens: where they go in the padded scores, where their log-probs
    # are, and their hypotheses' scores (flat positions, for one take and one copy each)
    rows, columns, sources, hypothesis_rows = [], [], [], []
    for row, (sentence, row_beams, row_tokens) in enumerate(
        zip(group, beams.tolist(), tokens.tolist(), strict=True)
    ):
        states, hypothesis_states = sentence.progress
        for hypothesis, state in enumerate(hypothesis_states):
            for token in states.next_tokens[state]:
                rows.append(row)
                columns.append(len(row_beams))
                hypothesis_rows.append(row * hypotheses + hypothesis)
                sources.append((row * hypotheses + hypothesis) * vocab + token)
                row_beams.append(hypothesis)
                row_tokens.append(token)
        advance, bank = states.advance, states.bank
        reached = [
            advance(hypothesis_states[b], t) for b, t in zip(row_beams, row_tokens, strict=True)
        ]
        lists.append(_Candidates(row_beams, row_tokens, reached, [bank[x] for x in reached]))
    if rows:
        longest = max(columns) + 1
        padded = scores.new_full((count, longest), -math.inf)
        padded[:, :width] = scores
        where = torch.tensor(
            [[r * longest + c for r, c in zip(rows, columns, strict=True)], sources,
             hypothesis_rows], device=scores.device,
        )  # fmt: skip
        values = lprobs.reshape(-1).take(where[1])
        if not first:  # the cumulative scores, added as fairseq adds them
            values = values + history.reshape(-1).take(where[2])
        padded.view(-1).index_copy_(0, where[0], values)
        scores = padded
    return scores, lists


def _best_each(lprobs: Tensor, history: Tensor) -> tuple[Tensor, Tensor]:
    """fairseq's ``torch.topk(lprobs + history, k=1)`` of each hypothesis, ``[sentences,
    hypotheses]`` each: the two best of each by ``top_candidates`` (our kernel on the CPU,
    without the sum written out), torch.topk itself for the rows whose two best are equal,
    where its order decides."""
    count, hypotheses, vocab = lprobs.shape
    rows = lprobs.view(count * hypotheses, 1, vocab)
    two_scores, two_tokens = top_candidates(rows, history.view(-1, 1), 2)
    best_scores, best_tokens = two_scores[:, 0], two_tokens[:, 0]
    tied = two_scores[:, 0].eq(two_scores[:, 1]).nonzero().view(-1)
    if tied.numel():
        again = rows.index_select(0, tied).view(-1, vocab) + history.view(-1, 1)[tied]
        tied_scores, tied_tokens = torch.topk(again, k=1, dim=1)
        best_scores, best_tokens = best_scores.clone(), best_tokens.clone()
        best_scores[tied], best_tokens[tied] = tied_scores.view(-1), tied_tokens.view(-1)
    return best_scores.view(count, hypotheses), best_tokens.view(count, hypotheses)


def _striped(
    group: list[ConstrainedSentence],
    scores: Tensor,
    lists: list[_Candidates],
    k: int,
    beam: int,
    eos: int,
) -> tuple[list[list[int]], list[list[bool]], list[list[int]], list[list[int]]]:
    """fairseq's ``step_sentence`` after its candidates, for each sentence: sort by (bank,
    score), strike duplicates, sort by stripes; then beam_step's choice. Per sentence: its ``k``
    candidates (positions in its lists), which of the first ``beam`` end in EOS, the next
    beam (positions among the ``k``), and the next beam's states."""
    # the sort by bank and score: fairseq's float32 keys, all sentences' at once
    count, width = scores.shape
    banks = torch.tensor([b for c in lists for b in c.banks + [0] * (width - len(c.banks))],
                         device=scores.device).view(count, width)  # fmt: skip
    weights = torch.tensor([[s.progress.states.sort_tokens] for s in group], device=scores.device)
    keys = (weights - banks) * MAX_SCORE + scores
    first_order = _sorted(
        [row[: len(c.tokens)] for row, c in zip(keys.tolist(), lists, strict=True)], True, keys
    )
    # duplicates struck (fairseq compares the first with the last too, and then keeps the
    # first's state in its list of states all the same), then stripes: the best of each bank
    # (highest first), then the second of each, ...
    kept_lists, state_lists, stripe_lists = [], [], []
    for row, order in enumerate(first_order):
        candidates = lists[row]
        pairs = [(candidates.beams[j], candidates.tokens[j]) for j in order]
        unique = [pairs[i] != pairs[i - 1] for i in range(len(pairs))]
        kept = [j for j, keep in zip(order, unique, strict=True) if keep]
        state_lists.append(kept if unique[0] else [order[0], *kept])
        weight, kept_count = group[row].progress.states.sort_tokens, len(kept)
        stripes, rank, current = [], -1, None
        banks = candidates.banks
        for j in kept:
            bank = banks[j]
            if current is None:
                current = bank
            if bank != current:
                rank, current = 0, bank
            else:
                rank += 1
            stripes.append(weight - bank + rank * (kept_count + 1))
        kept_lists.append(kept)
        stripe_lists.append(stripes)
    stripe_order = _sorted(stripe_lists, False)
    # as beam_step: an EOS with a finite score ends; the first beam others go on
    picked, ending, alive, next_states = [], [], [], []
    score_rows = scores.tolist()
    for row, order in enumerate(stripe_order):
        candidates, kept, state_list = lists[row], kept_lists[row], state_lists[row]
        chosen = [kept[j] for j in order[:k]]
        is_eos = [candidates.tokens[j] == eos and score_rows[row][j] != -math.inf for j in chosen]
        goes_on = sorted(range(len(is_eos)), key=is_eos.__getitem__)  # stable: EOS last
        picked.append(chosen)
        ending.append(is_eos[:beam])
        alive.append(goes_on[:beam])
        next_states.append([candidates.states[state_list[order[i]]] for i in goes_on[:beam]])
    return picked, ending, alive, next_states


def _sorted(rows: list[list], descending: bool, keys: Tensor | None = None) -> list[list[int]]:
    """The order ``torch.sort`` gives each of ``rows`` (each sentence's keys, sorted alone in
    fairseq). Where a row's keys all differ the order is theirs, whatever sorts them (Python
    here, cheaper than a tensor operation); rows with equal keys (or NaN) are sorted by
    torch.sort (on ``keys``, their tensor padded, where given), those of one length together:
    its order among equal keys depends on the length alone, not on the rows beside."""
    orders: list[list[int]] = []
    tied: dict[int, list[int]] = defaultdict(list)
    for row, values in enumerate(rows):
        length = len(values)
        if len(set(values)) == length and all(v == v for v in values):
            orders.append(sorted(range(length), key=values.__getitem__, reverse=descending))
        else:
            orders.append([])
            tied[length].append(row)
    for length, same in tied.items():
        if keys is None:
            chosen = torch.tensor([rows[row] for row in same])
        else:
            chosen = keys[torch.tensor(same, device=keys.device), :length]
        order = chosen.sort(dim=1, descending=descending).indices.tolist()
        for row, one in zip(same, order, strict=True):
            orders[row] = one
    return orders

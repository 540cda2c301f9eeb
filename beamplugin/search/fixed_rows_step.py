"""The search's step on fixed-capacity rows, whole on the device: fairseq's per-step rules, the
2 x beam candidates, the hypotheses that end kept in each sentence's n-best rows, which
sentences are done, and the next beam, in static shapes with no host synchronisation (the
search half of beamplugin.engine.device_engine's step; a CUDA graph replays it).

Sentence slot ``s`` owns rows ``s * beam .. s * beam + beam - 1`` for its whole life. Its
tokens and cumulative scores are left-aligned (column 0: BOS and 0; column ``t + 1``: after its
token ``t``). Slots past the live ones run too (a bucket is padded to a power of two); their
``active`` flag is off, so they write nothing that a live sentence reads.

The rules and the candidates follow fairseq's ``SequenceGenerator`` as beamplugin.search's
``beam_step`` and ``log_prob_rules`` do: pad never, EOS not before ``min_len``, the unk penalty,
only EOS at the maximum length, ``2 x beam`` candidates by one ``torch.topk``, an EOS candidate
ends a hypothesis when it ranks in the top ``beam``, the first ``beam`` other candidates go on,
and a sentence keeps the first ``beam`` hypotheses that end (fairseq's stopping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from beamplugin.search.beam_step import length_normaliser
from beamplugin.search.options import DecodingOptions

ROW, SLOT, ENDED = "row", "slot", "ended"  # what a state tensor has one entry of along dim 0


def unsupported(options: DecodingOptions) -> str | None:
    """What in ``options`` this step does not do (None: it does them all)."""
    reasons = {
        "stopping='exact'": options.stopping != "fairseq",
        "match_source_len": options.match_source_len,
        "length constraints": options.length_constraints is not None,
        "a vocabulary shortlist": options.shortlist is not None,
        "lexical constraints": options.constraints is not None,
        "attention or alignments": options.attention or options.print_alignment is not None,
    }
    named = [name for name, on in reasons.items() if on]
    return ", ".join(named) or None


@dataclass
class SearchState:
    """The search's tensors, for ``slots`` sentences of ``beam`` rows and ``columns`` tokens a
    row (BOS included), on one device."""

    tokens: Tensor  # [rows, columns + 1] each row's tokens, left-aligned, BOS first
    cumulative: Tensor  # [rows, columns + 1] float32 cumulative score after each token
    next_tokens: Tensor  # [rows] the token each row is fed at the next step
    reorder: Tensor  # [rows] the row whose decoder history each row takes at the next step
    scores: Tensor  # [slots, beam] float32 cumulative score of each live hypothesis
    steps: Tensor  # [slots] output tokens each sentence has
    max_lens: Tensor  # [slots] output tokens before EOS is forced
    prefixes: Tensor  # [slots, prefix width] forced first tokens, pad: free choice
    prefix_lens: Tensor  # [slots] steps its forced prefix covers (its request's prefix width)
    active: Tensor  # [slots] bool: a live sentence, still searching
    done: Tensor  # [slots] bool: its search ended (its n-best rows are final)
    counts: Tensor  # [slots] hypotheses its n-best holds
    # [slots x beam + 1] its n-best: hypotheses that ended, in the order they ended (the last
    # row takes what no n-best keeps)
    ended_tokens: Tensor  # [., columns + 1] BOS, tokens, EOS
    ended_cumulative: Tensor  # [., columns + 1] float32 cumulative scores, EOS's last
    ended_scores: Tensor  # [.] float32 the score that ranks it (normalised)
    ended_lengths: Tensor  # [.] tokens, EOS included

    KINDS = {
        "tokens": ROW, "cumulative": ROW, "next_tokens": ROW, "reorder": ROW,
        "scores": SLOT, "steps": SLOT, "max_lens": SLOT, "prefixes": SLOT,
        "prefix_lens": SLOT, "active": SLOT, "done": SLOT,
        "counts": SLOT, "ended_tokens": ENDED, "ended_cumulative": ENDED,
        "ended_scores": ENDED, "ended_lengths": ENDED,
    }  # fmt: skip

    @classmethod
    def empty(
        cls, slots: int, beam: int, columns: int, device: torch.device, prefix: int = 0
    ) -> SearchState:
        rows, ended = slots * beam, slots * beam + 1

        def longs(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        def floats(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float32, device=device)

        def flags(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.bool, device=device)

        return cls(
            tokens=longs(rows, columns + 1), cumulative=floats(rows, columns + 1),
            next_tokens=longs(rows), reorder=torch.arange(rows, device=device),
            scores=floats(slots, beam), steps=longs(slots), max_lens=longs(slots),
            prefixes=longs(slots, prefix), prefix_lens=longs(slots),
            active=flags(slots), done=flags(slots), counts=longs(slots),
            ended_tokens=longs(ended, columns + 1), ended_cumulative=floats(ended, columns + 1),
            ended_scores=floats(ended), ended_lengths=longs(ended),
        )  # fmt: skip

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def grown(self, slots: int, beam: int, columns: int, prefix: int) -> SearchState:
        """A state with room for more, holding this one's contents at the same places (the
        n-best rows that take nothing move to the new last row)."""
        new = SearchState.empty(slots, beam, columns, self.scores.device, prefix)
        for name, tensor in self.tensors().items():
            target = getattr(new, name)
            kept = tensor[:-1] if self.KINDS[name] == ENDED else tensor
            if name == "reorder":
                continue  # identity: nothing is pending when a state grows (between steps)
            target[tuple(slice(0, size) for size in kept.shape)] = kept
        return new


class Rules:
    """What the step needs of the options, on the device: the special tokens, the suppressed
    ones, and the length normalisers of every length up to ``columns`` tokens."""

    def __init__(self, options: DecodingOptions, columns: int, device: torch.device) -> None:
        self.options = options
        self.beam, self.eos, self.pad, self.unk = (
            options.beam_size, options.eos, options.pad, options.unk,
        )  # fmt: skip
        self.suppressed = (
            torch.tensor(options.suppressed, dtype=torch.long, device=device)
            if options.suppressed else None
        )  # fmt: skip
        # the host's float normaliser of each length, as float32 (the engine's divisor)
        divisors = [
            length_normaliser(n, options.len_penalty, options.length_penalty_style)
            if n else 1.0
            for n in range(columns + 2)
        ]
        self.normalisers = torch.tensor(divisors, dtype=torch.float32, device=device)


def mask(
    lprobs: Tensor, steps: Tensor, max_lens: Tensor, forced: Tensor | None,
    in_prefix: Tensor | None, rules: Rules,
) -> None:  # fmt: skip
    """fairseq's rules on ``lprobs`` ``[rows, vocab]`` in place, each row at its sentence's
    ``steps`` of ``max_lens``, in its forced prefix or not (``in_prefix``), ``forced`` the
    token its prefix forces now (pad: none) (all ``[rows]``; None: no prefixes): NaN and pad
    -inf, suppressed tokens and EOS before ``min_len`` outside a prefix, the unk penalty, only
    EOS at the maximum length, only the forced token."""
    options = rules.options
    lprobs.masked_fill_(lprobs.isnan(), -math.inf)
    lprobs[:, rules.pad].fill_(-math.inf)  # in-place ops: no scalar tensor made from Python
    if rules.suppressed is not None:
        if in_prefix is None:
            lprobs.index_fill_(1, rules.suppressed, -math.inf)
        else:
            suppressed = lprobs.index_fill(1, rules.suppressed, -math.inf)
            lprobs.copy_(torch.where(in_prefix.unsqueeze(1), lprobs, suppressed))
    if options.min_len > 0:
        short = steps < options.min_len
        if in_prefix is not None:
            short &= ~in_prefix
        lprobs[:, rules.eos].masked_fill_(short, -math.inf)
    if options.unk_penalty:
        lprobs[:, rules.unk].sub_(options.unk_penalty)
    eos = lprobs[:, rules.eos].clone()
    lprobs.masked_fill_((steps >= max_lens).unsqueeze(1), -math.inf)
    lprobs[:, rules.eos].copy_(eos)
    if forced is None:
        return
    column = forced.unsqueeze(1)
    kept = lprobs.gather(1, column)
    lprobs.masked_fill_(forced.ne(rules.pad).unsqueeze(1), -math.inf)
    lprobs.scatter_(1, column, kept)  # rows forcing nothing: pad's -inf, as it was


def step(lprobs: Tensor, state: SearchState, rules: Rules, slots: int, columns: int) -> None:
    """One beam step of the first ``slots`` sentence slots from ``lprobs`` ``[slots x beam,
    vocab]`` (float32, each row's next-token log-probs), applied to ``state`` in place; the
    rows' token and score histories are read and written in their first ``columns + 1``
    columns."""
    beam, eos = rules.beam, rules.eos
    rows, vocab = lprobs.shape
    device = lprobs.device
    active = state.active[:slots]
    steps = state.steps[:slots]
    max_lens = state.max_lens[:slots]
    row_steps = _each_row(steps, beam)
    first_rows = torch.arange(0, rows, beam, device=device).unsqueeze(1)
    # no prefix in the state's capacity (none was ever admitted): no prefix work in the step
    forced = in_prefix = None
    if state.prefixes.size(1):
        in_prefix = steps.lt(state.prefix_lens[:slots]) & steps.lt(max_lens)
        last = state.prefixes.size(1) - 1
        forced = state.prefixes[:slots].gather(1, steps.clamp(max=last).unsqueeze(1)).squeeze(1)
        forced = torch.where(in_prefix, forced, rules.pad)
    mask(lprobs, row_steps, _each_row(max_lens, beam),
         None if forced is None else _each_row(forced, beam),
         None if in_prefix is None else _each_row(in_prefix, beam), rules)  # fmt: skip
    if rules.options.no_repeat_ngram_size:
        block_repeated_ngrams(lprobs, state.tokens[:rows, : columns + 1], row_steps,
                              rules.options.no_repeat_ngram_size)  # fmt: skip
    if forced is not None:
        lprobs = _first_beam_where_eos_forced(lprobs, state, forced.eq(eos), first_rows, columns)
    total = (lprobs.view(slots, beam, vocab) + state.scores[:slots].unsqueeze(2)).view(slots, -1)
    cand_scores, flat = torch.topk(total, 2 * beam)
    cand_beams = torch.div(flat, vocab, rounding_mode="floor")
    cand_tokens = flat.remainder(vocab)
    ends = cand_tokens.eq(eos) & cand_scores.ne(-math.inf)
    _keep_ended(state, rules, slots, columns, active, steps, ends, cand_scores,
                first_rows + cand_beams[:, :beam])  # fmt: skip
    order = torch.sort(ends, dim=1, stable=True).indices[:, :beam]
    alive_beams = cand_beams.gather(1, order)
    alive_tokens, alive_scores = cand_tokens.gather(1, order), cand_scores.gather(1, order)
    # the next beam: each row takes its hypothesis' history, then its new token and score
    keep = _each_row(active, beam)
    own = torch.arange(rows, device=device)
    reorder = torch.where(keep, (first_rows + alive_beams).view(-1), own)
    state.reorder[:rows] = reorder
    width = columns + 1
    tokens, cumulative = state.tokens[:, :width], state.cumulative[:, :width]
    tokens[:rows] = tokens.index_select(0, reorder)
    cumulative[:rows] = cumulative.index_select(0, reorder)
    column = (row_steps + 1).clamp_(max=columns).unsqueeze(1)
    fed = torch.where(keep, alive_tokens.view(-1), state.next_tokens[:rows])
    tokens[:rows].scatter_(1, column, fed.unsqueeze(1))
    cumulative[:rows].scatter_(1, column, alive_scores.reshape(-1, 1))
    state.next_tokens[:rows] = fed
    state.scores[:slots] = torch.where(active.unsqueeze(1), alive_scores, state.scores[:slots])
    at_max = steps >= state.max_lens[:slots]
    finished = active & (state.counts[:slots].ge(beam) | at_max)
    state.steps[:slots] = steps + active.long()
    state.done[:slots] |= finished
    state.active[:slots] = active & ~finished


def block_repeated_ngrams(lprobs: Tensor, tokens: Tensor, steps: Tensor, size: int) -> None:
    """Set to -inf, in place, every next token that would repeat an n-gram of ``size`` tokens of
    a row's history (fairseq's ``--no-repeat-ngram-size``): ``tokens`` ``[rows, width]`` each
    row's tokens left-aligned, BOS first, its own up to column ``steps[r]`` (what follows is
    another row's or nothing's, never matched), ``lprobs`` ``[rows, vocab]``."""
    context = size - 1
    rows, width = tokens.shape
    positions = torch.arange(width, device=tokens.device)
    if context == 0:  # unigrams: no generated token (BOS excluded) may come again
        generated = (positions >= 1) & (positions <= steps.unsqueeze(1))
        penalty = torch.zeros_like(tokens, dtype=lprobs.dtype).masked_fill_(generated, -math.inf)
        lprobs.scatter_add_(1, tokens, penalty)
        return
    if width <= context:
        return
    # the last `context` tokens of each row (clamped where it has fewer: no window then)
    last = (steps.unsqueeze(1) - context + 1 + torch.arange(context, device=tokens.device))
    current = tokens.gather(1, last.clamp(min=0))
    windows = tokens.unfold(1, context, 1)[:, : width - context]  # those with a follower
    starts = positions[: width - context]
    earlier = starts.unsqueeze(0) <= (steps - context).unsqueeze(1)  # followed by its own token
    matches = windows.eq(current.unsqueeze(1)).all(dim=2) & earlier
    penalty = torch.zeros(matches.shape, dtype=lprobs.dtype, device=lprobs.device)
    lprobs.scatter_add_(1, tokens[:, context:], penalty.masked_fill_(matches, -math.inf))


def _first_beam_where_eos_forced(
    lprobs: Tensor, state: SearchState, eos_forced: Tensor, first_rows: Tensor, columns: int
) -> Tensor:
    """Where a forced prefix forces EOS now (``eos_forced`` ``[slots]``), every beam of the
    sentence becomes a copy of its first (log-probs, tokens, scores), as fairseq's
    ``replicate_first_beam``: the only beam that followed the prefix."""
    slots = eos_forced.size(0)
    beam = lprobs.size(0) // slots
    rows = torch.arange(lprobs.size(0), device=lprobs.device)
    source = torch.where(_each_row(eos_forced, beam), _each_row(first_rows.view(-1), beam), rows)
    width = columns + 1
    tokens, cumulative = state.tokens[:, :width], state.cumulative[:, :width]
    tokens[: rows.size(0)] = tokens.index_select(0, source)
    cumulative[: rows.size(0)] = cumulative.index_select(0, source)
    scores = state.scores[:slots]
    scores.copy_(torch.where(eos_forced.unsqueeze(1), scores[:, :1].expand_as(scores), scores))
    return lprobs.index_select(0, source)


def _keep_ended(
    state: SearchState, rules: Rules, slots: int, columns: int, active: Tensor, steps: Tensor,
    ends: Tensor, cand_scores: Tensor, cand_rows: Tensor,
) -> None:  # fmt: skip
    """Into each active sentence's n-best rows, the first of its top ``beam`` candidates that
    end in EOS, while it holds fewer than ``beam`` (fairseq's rule): ``cand_rows`` ``[slots,
    beam]`` the row each extends."""
    beam = rules.beam
    ending = ends[:, :beam] & active.unsqueeze(1)
    place = state.counts[:slots].unsqueeze(1) + ending.long().cumsum(1) - 1
    kept = ending & place.lt(beam)
    nowhere = state.ended_scores.size(0) - 1
    first_rows = torch.arange(0, slots * beam, beam, device=ends.device).unsqueeze(1)
    target = torch.where(kept, first_rows + place, nowhere).view(-1)
    width = columns + 1
    source = cand_rows.reshape(-1)
    column = _each_row((steps + 1).clamp(max=columns), beam).unsqueeze(1)
    eos_scores = cand_scores[:, :beam].reshape(-1, 1)
    tokens = state.tokens[:, :width].index_select(0, source).scatter_(1, column, rules.eos)
    cumulative = state.cumulative[:, :width].index_select(0, source).scatter_(1, column, eos_scores)
    lengths = _each_row(steps + 1, beam)
    scores = eos_scores.view(-1)
    if rules.options.normalize_scores:
        scores = scores / rules.normalisers.index_select(0, lengths)
    state.ended_tokens[:, :width].index_copy_(0, target, tokens)
    state.ended_cumulative[:, :width].index_copy_(0, target, cumulative)
    state.ended_scores.index_copy_(0, target, scores)
    state.ended_lengths.index_copy_(0, target, lengths)
    state.counts[:slots] += kept.sum(1)


def _each_row(per_sentence: Tensor, beam: int) -> Tensor:
    """``[slots]`` -> ``[slots x beam]``: each sentence's value on each of its rows (an
    expand, not ``repeat_interleave``, which may wait for the device to size its output)."""
    return per_sentence.unsqueeze(1).expand(-1, beam).reshape(-1)

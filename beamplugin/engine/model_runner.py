"""The model side of a step: encoding the admitted requests, the decoder rows (each row's
token history, score history and attention history, and the models' incremental states), one
decoder forward for every row, and moving the rows as hypotheses are reordered, sentences leave
and new ones join. Histories are right-aligned: rows of sentences at different steps are
left-padded."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.engine.scheduler import Encoded, Waiting
from beamplugin.engine.slots import Sentence, Slots, stack_padded
from beamplugin.runtime.host_transfer import to_device
from beamplugin.search.beam_step import BeamStep
from beamplugin.search.options import DecodingOptions


class Pending(NamedTuple):
    """A step's search result, applied to the decoder rows at the start of the next step (so
    that sentences admitted in between join in the same reorder)."""

    res: BeamStep
    attn: Tensor | None  # the step's attention
    order: Tensor | None  # old slot of each sentence that stays, if some moved


class ModelRunner:
    """Runs ``model`` for the sentences of ``slots``; new rows start with their request's BOS,
    or else ``bos``."""

    def __init__(self, model: EnsembleDecoder, options: DecodingOptions, bos: int) -> None:
        self.model = model
        self.options = options
        self.beam = options.beam_size
        self.bos = bos
        self.reorderers = model.reorderers()
        self.states: list[dict] = []
        self.tokens: Tensor | None = None  # [rows, steps + 1] BOS first
        self.cumulative: Tensor | None = None  # [rows, steps] cumulative score history
        self.attention: Tensor | None = None  # [rows, steps, src] attention history
        # [sentences with beam rows, hypotheses] cumulative scores (one hypothesis each at the
        # first step of models that decode it in beam identical rows)
        self.scores: Tensor | None = None

    def encode(self, groups: list[list[Waiting]]) -> None:
        """Encode each group of requests in one forward; each request learns its rows."""
        encode(self.model, self.options, groups)

    def advance(self, slots: Slots, pending: Pending | None) -> None:
        """Rows for this step: last step's hypotheses in their new beam order, the sentences
        that left gone, new sentences appended (BOS, zeroed state)."""
        beam = self.beam
        if pending is None:  # every sentence is new: a new batch
            slots.start_step()
            self.tokens = self.first_tokens(slots.live, 1 if slots.one_row else beam, slots.device)
            self.cumulative = self.attention = self.scores = None
            self.states = [{} for _ in self.model.models]
            return
        res, attn, order = pending
        # every sentence of the last step: beam hypotheses (from one row if it had one)
        first_rows = slots.layout(res.alive_beams.size(0), slots.one_row)[0].unsqueeze(1)
        alive_beams, alive_tokens = res.alive_beams, res.alive_tokens
        alive_scores = res.alive_scores
        if order is not None:  # sentences left: the others in their new slots
            alive_beams, first_rows = alive_beams[order], first_rows[order]
            alive_tokens, alive_scores = alive_tokens[order], alive_scores[order]
        rows = (alive_beams + first_rows).view(-1)
        new_tokens, scores, row_scores = alive_tokens.view(-1, 1), alive_scores, alive_scores
        fresh = slots.start_step()
        fresh_rows = slots.one_row or fresh * beam
        if fresh:
            # New sentences' rows: BOS after padding, score 0. Models that decode a first step
            # in beam identical rows get one live hypothesis and beam - 1 dead copies.
            rows = torch.cat([rows, rows.new_zeros(fresh_rows)])  # placeholders, reset below
            rows_each = 1 if slots.one_row else beam
            first = self.first_tokens(slots.live[-fresh:], rows_each, slots.device)
            new_tokens = torch.cat([new_tokens, first])
            if slots.one_row:
                row_scores = torch.cat([row_scores.view(-1), scores.new_zeros(fresh)])
            else:
                start = scores.new_full((fresh, beam), -math.inf)
                start[:, 0] = 0
                scores = row_scores = torch.cat([scores, start])
        self.tokens = torch.cat([self.tokens.index_select(0, rows), new_tokens], 1)
        self.cumulative = torch.cat(
            [self.cumulative.index_select(0, rows), row_scores.view(-1, 1)], 1
        )
        if attn is not None:
            steps = torch.cat([fit_width(self.attention, attn.size(1)), attn.unsqueeze(1)], 1)
            self.attention = steps.index_select(0, rows)
        history = max(s.step for s in slots.live)  # tokens after BOS the longest one has
        if self.cumulative.size(1) > history:  # the longest ones left: drop their columns
            self.tokens = self.tokens[:, -(history + 1) :]
            self.cumulative = self.cumulative[:, -history:]
            if attn is not None:
                self.attention = self.attention[:, -history:]
        if fresh:
            self.tokens[-fresh_rows:, :-1] = self.options.pad
        self.scores = scores
        self.model.reorder_states(self.reorderers, self.states, rows, fresh_rows)

    def release(self) -> None:
        """Let go of the rows' state once no sentence is in flight: the decoders' incremental
        states (their history buffers go back to the pool for the next batch, their views of
        the encoder memory free it) are not held beside the next admission's encoding."""
        self.states = []
        self.tokens = self.cumulative = self.attention = self.scores = None

    def first_tokens(
        self, sentences: list[Sentence], rows_each: int, device: torch.device | None
    ) -> Tensor:
        """``[rows, 1]`` the first token of new sentences' rows: each request's own BOS, or the
        engine's."""
        if all(s.bos is None for s in sentences):
            return torch.full((len(sentences) * rows_each, 1), self.bos, dtype=torch.long,
                              device=device)  # fmt: skip
        own = [self.bos if s.bos is None else s.bos for s in sentences]
        return to_device(own, device).repeat_interleave(rows_each).unsqueeze(1)

    def forward(self, slots: Slots) -> tuple[Tensor, Tensor | None]:
        """One decoder forward for every row: log-probs ``[rows, vocab]`` and attention
        ``[rows, src]`` (or None)."""
        options = self.options
        lprobs, attn = self.model.decode_step(
            self.tokens, slots.memory_views(), self.states, options.temperature,
            options.attention, slots.output_columns(),
        )  # fmt: skip
        if self.cumulative is None:  # the first step of a new batch
            self.scores = lprobs.new_zeros(len(slots.live) - slots.one_row, 1)
            self.cumulative = lprobs.new_empty(lprobs.size(0), 0)
        if attn is not None and self.attention is None:
            self.attention = attn.new_empty(attn.size(0), 0, attn.size(1))
        return lprobs, attn

    def copy_rows(self, source: Tensor) -> None:
        """Make each row a copy of row ``source[row]`` (a forced prefix ended in EOS)."""
        self.tokens = self.tokens.index_select(0, source)
        self.cumulative = self.cumulative.index_select(0, source)
        multi, hypotheses = self.scores.shape
        if hypotheses == self.beam:  # else one score per sentence: unchanged
            self.scores = self.scores.reshape(-1)[source[: multi * hypotheses]].view_as(self.scores)

    def history(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The token and cumulative score histories of ``rows``."""
        return self.tokens.index_select(0, rows), self.cumulative.index_select(0, rows)

    def attention_history(self, rows: Tensor, attn: Tensor) -> Tensor:
        """``[rows, steps + 1, src]``: the attention history of ``rows`` and this step's."""
        history = fit_width(self.attention, attn.size(1)).index_select(0, rows)
        return torch.cat([history, attn.index_select(0, rows).unsqueeze(1)], 1)


def fit_width(history: Tensor, width: int) -> Tensor:
    """``history`` ``[rows, steps, src]`` left-padded with zeros or cut on the left to
    ``width`` source positions (the memory pool widened or narrowed)."""
    src = history.size(2)
    if src == width:
        return history
    if src > width:
        return history[:, :, src - width :]
    return F.pad(history, (width - src, 0))


def encode(model: EnsembleDecoder, options: DecodingOptions, groups: list[list[Waiting]]) -> None:
    """Encode each group of requests in one forward (sources left-padded to the group's
    widest); each request learns its rows of the output."""
    for group in groups:
        requests = [w.request for w in group]
        net_input = {
            "src_tokens": stack_padded([r.src_tokens for r in requests], options.pad, left=True),
            "src_lengths": torch.cat([r.source_lengths(options) for r in requests]),
        }
        outs = model.encode(net_input)
        row = 0
        for item in group:
            item.encoded = Encoded(outs, slice(row, row + len(item.request.keys)))
            row += len(item.request.keys)

"""The decoding engine: admits sentences, advances all of them with one decoder forward per
step, and retires those that are finished; new sentences can join while others are mid-search
(continuous batching).

Data flow of a step: the rows of every sentence in flight (sentence-major, ``beam`` rows each,
and one row for each sentence at its first step when every model allows it: those come last;
the others in two blocks of similar source width, for the attention) go through the decoder;
the log-prob rules mask them; the beam step picks candidates; the n-best keepers take the
hypotheses that end; finished sentences leave, and their slots go to the next sentences.

Sentences at different steps can share a forward only when every model mixes steps (see
beamplugin.ensemble); otherwise new sentences are admitted when the engine is empty, which is
fairseq's batch-at-a-time decoding. A sentence's own state is all it depends on: its results
are those it gets when decoded alone, whoever shares its steps.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.heap import keep_freed_memory
from beamplugin.host_transfer import to_device, to_host
from beamplugin.log_prob_rules import LogProbRules
from beamplugin.search import BeamStep, beam_step, concat_steps, length_normaliser
from beamplugin.search.nbest import Hypothesis, NBest

if TYPE_CHECKING:
    from beamplugin.sequence_generator import SequenceGenerator

logger = logging.getLogger(__name__)

# Sentences that join mid-search are encoded ahead, together, in groups of similar source
# width: a forward costs as much as ENCODER_FORWARD_TOKENS padded tokens more, since the encoder
# reads all its weights once per forward (demo model, 1 thread: 1.0 ms + 0.038 ms per token).
ENCODER_FORWARD_TOKENS = 26
# Requests taken ahead of room for them, grouped for the encoder together and admitted in
# width order (see DecodingEngine._plan): at least
# ENCODE_AHEAD, or ENCODE_AHEAD_PER_SLOT times the capacity in sentences if more: random
# arrivals sort into fewer, denser width groups among more (1000 random arrivals, demo model:
# the encoder takes 0.77 s in windows of 64, 0.65 s of 256, 0.63 s of 512 at capacity 16;
# static batches of the sorted sentences 0.65 s). Each group is encoded only when its first
# request joins, so a wide window holds little encoder output.
ENCODE_AHEAD = 512
ENCODE_AHEAD_PER_SLOT = 8
# While sentences are decoding and more may come (a server), fewer than ENCODE_GROUP waiting
# sentences wait up to MAX_ADMISSION_DELAY steps for others to be encoded with: the encoder
# reads all its weights once per forward, so a sentence alone costs twice as much to encode as
# one of a group of 8 (demo model, 1 thread: 2.7 against 1.2 ms).
ENCODE_GROUP = 8
MAX_ADMISSION_DELAY = 2


@dataclass
class Request:
    """Sentences admitted together.

    Limits that depend on the source are computed per request, as fairseq computes them per
    batch: ``max_len_a`` multiplies the request's (padded) width, ``match_source_len`` takes its
    longest source. A request of one sentence gets limits from that sentence alone.
    """

    keys: list[Any]  # one per sentence: what its Finished result carries back
    src_tokens: Tensor  # [sentences, width], left-padded, each row ending in EOS
    # [sentences] as fairseq's collater counts them (EOS included); if None, as fairseq's
    # generator then counts them (without EOS)
    src_lengths: Tensor | None = None
    prefix_tokens: Tensor | None = None  # [sentences, p] forced first tokens, pad: free choice
    max_len: int = -1  # output tokens before EOS is forced: set by DecodingEngine.check

    @property
    def width(self) -> int:
        return self.src_tokens.size(1)


class Finished(NamedTuple):
    """A sentence's hypotheses, best first, or why it could not be decoded."""

    key: Any
    hypotheses: list[Hypothesis]
    error: Exception | None = None


@dataclass(eq=False)
class _Sentence:
    """Host-side record of a sentence in flight."""

    key: Any
    src_tokens: Tensor  # its row of the request, padding included
    width: int  # of its request: the source length fairseq's max_len_a and attention see
    max_len: int  # output tokens before EOS is forced
    prefix_len: int  # steps its forced prefix covers (its request's prefix width)
    prefix_end: int  # step at which its prefix forces EOS, -1 if none does
    nbest: NBest
    step: int = 0  # output tokens it has
    block: int = 0  # its width block among the sentences with beam rows (see _admit)


class DecodingEngine:
    """Beam search over sentences in flight, bounded by ``max_sentences`` sentences and
    ``max_tokens`` (each sentence counts beam x its source width); ``None``: unbounded."""

    def __init__(
        self,
        gen: SequenceGenerator,
        max_sentences: int | None = None,
        max_tokens: int | None = None,
        bos_token: int | None = None,
    ) -> None:
        keep_freed_memory()  # steps allocate the same sizes again and again
        self.gen = gen
        self.model = gen.model
        self.beam = gen.beam_size
        self.max_sentences, self.max_tokens = max_sentences, max_tokens
        self.bos = gen.eos if bos_token is None else bos_token
        self.rules = LogProbRules(gen)
        self.live: list[_Sentence] = []
        self.waiting: deque[_Waiting] = deque()  # checked requests not in flight yet
        # requests taken ahead of room for them and grouped for the encoder (models that mix
        # steps)
        self.encode_ahead = (
            max(ENCODE_AHEAD_PER_SLOT * (max_sentences or 0), ENCODE_AHEAD)
            if max_sentences or max_tokens else math.inf
        )
        self.fresh = 0  # the last `fresh` live sentences were admitted since the last step
        self.tokens_in_flight = 0
        self.memories = self.model.encoder_memories(self.beam)
        self.reorderers = self.model.reorderers()
        self.states: list[dict] = []
        # Per live sentence, on the device (rearranged as sentences come and go).
        self.per_sentence: dict[str, Tensor] = {}
        # Decoder rows: right-aligned histories, left-padded where sentences differ in step.
        # The last `one_row` live sentences have one row this step (their first), the others
        # beam rows.
        self.one_row = 0
        self.tokens: Tensor | None = None  # [rows, steps + 1] BOS first
        self.cumulative: Tensor | None = None  # [rows, steps] cumulative score history
        self.attention: Tensor | None = None  # [rows, steps, src] attention history
        # [sentences with beam rows, hypotheses] cumulative scores (one hypothesis each at the
        # first step of models that decode it in beam identical rows)
        self.scores: Tensor | None = None
        self._pending: _Pending | None = None  # last step's result, applied by the next
        self._layouts: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._steps_on_device: Tensor | None = None
        self.device: torch.device | None = None
        self.refills = 0  # sentences admitted while others were mid-search
        self.steps = 0  # decoder steps taken
        if not self.model.mixes_steps and (max_sentences or max_tokens):
            logger.info(
                "these models cannot decode sentences at different steps in one forward: new "
                "sentences are admitted when the batch is empty (no continuous batching)"
            )

    # ---- admission -------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` can never be decoded here; else set its max_len."""
        limit = self.model.max_source_positions()
        if request.width > limit:
            raise ValueError(
                f"a source of {request.width} tokens is longer than the model accepts "
                f"({limit} tokens, end of sentence included)"
            )
        if self.max_sentences and len(request.keys) > self.max_sentences:
            raise ValueError(
                f"{len(request.keys)} sentences at once, more than the capacity of "
                f"{self.max_sentences} sentences"
            )
        cost = self.beam * request.width * len(request.keys)
        if self.max_tokens and cost > self.max_tokens:
            raise ValueError(
                f"a source of {request.width} tokens needs {cost} tokens with beam {self.beam}, "
                f"more than the capacity of {self.max_tokens} tokens"
            )
        request.max_len = self._output_limit(request)

    def _fitting(self, requests: Iterable[Request]) -> int:
        """How many of ``requests``, from the first, the engine has room for now."""
        if self.live and not self.model.mixes_steps:
            return 0
        fitting, count, cost = 0, len(self.live), self.tokens_in_flight
        for request in requests:
            count += len(request.keys)
            cost += self.beam * request.width * len(request.keys)
            if (self.max_sentences and count > self.max_sentences) or (
                self.max_tokens and cost > self.max_tokens
            ):
                break
            fitting += 1
        return fitting

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing waiting."""
        return not self.live and not self.waiting

    def wants_requests(self) -> bool:
        """Whether to take another request: until ``encode_ahead`` wait, for models that mix
        steps (grouped for the encoder together, they join one by one as slots free up);
        otherwise while all that wait fit into the next batch."""
        if self.model.mixes_steps:
            return len(self.waiting) < self.encode_ahead
        return not self.live and self._fitting(self._waiting_requests()) == len(self.waiting)

    def enqueue(self, request: Request) -> None:
        """Let ``request`` (checked) wait for room."""
        self.waiting.append(_Waiting(request, self.steps))

    def admit_waiting(self, more_coming: bool = False) -> None:
        """Put the waiting requests that fit in flight, in their order (see _plan), encoded
        first (see _encode). ``more_coming``: more requests may arrive soon, so while others
        decode, a few may wait a little to be planned and encoded together (ENCODE_GROUP)."""
        count = self._fitting(self._waiting_requests())
        if not count:
            return
        if self.model.mixes_steps and self.waiting[count - 1].group is None:
            if more_coming and self.live and self._gathering():
                return
            self._plan()
            count = self._fitting(self._waiting_requests())
            if not count:
                return
        admitted = list(itertools.islice(self.waiting, count))
        if any(item.encoded is None for item in admitted):
            self._encode(admitted)
        self._admit([self.waiting.popleft() for _ in range(count)])

    def _gathering(self) -> bool:
        """Whether the waiting requests, not planned yet, should wait for more (never once
        the engine takes no more ahead)."""
        sentences = sum(len(w.request.keys) for w in self.waiting)
        return (
            sentences < ENCODE_GROUP
            and len(self.waiting) < self.encode_ahead
            and self.steps - self.waiting[0].since < MAX_ADMISSION_DELAY
        )

    def _plan(self) -> None:
        """Group the waiting requests not planned yet for the encoder, and queue them in the
        groups' order, narrowest first, after those planned before: a window of requests taken
        ahead joins in width order, so the sentences in flight are of similar width and the
        attention reads few padded positions (1000 random arrivals at capacity 64: 276k
        sentence-positions per layer against 370k in arrival order; static batches of the sorted
        sentences 261k). A request waits at most for the windows planned before its own."""
        planned = [w for w in self.waiting if w.group is not None]
        groups = _similar_widths([w for w in self.waiting if w.group is None])
        for group in groups:
            for item in group:
                item.group = group
        self.waiting = deque(planned + [item for group in groups for item in group])

    def _waiting_requests(self) -> Iterator[Request]:
        return (w.request for w in self.waiting)

    def _encode(self, admitted: list[_Waiting]) -> None:
        """Encode the requests about to be admitted. Models that mix steps encode them in their
        planned groups (rows in their order), each group when the first of it is admitted: a
        window of requests is grouped as a whole, but its encoding is spread over the steps
        (the sentences in flight wait while the encoder runs). Other models encode the
        admitted batch, as fairseq does."""
        if not self.model.mixes_steps:
            groups = [admitted]
        else:
            unencoded = (item.group for item in admitted if item.encoded is None)
            groups = list({id(group): group for group in unencoded}.values())
        for group in groups:
            requests = [w.request for w in group]
            net_input = {
                "src_tokens": _stack_padded([r.src_tokens for r in requests], self.gen.pad,
                                            left=True),
                "src_lengths": torch.cat([_source_lengths(r, self.gen) for r in requests]),
            }
            outs = self.model.encode(net_input)
            row = 0
            for item in group:
                item.encoded = _Encoded(outs, slice(row, row + len(item.request.keys)))
                row += len(item.request.keys)

    def _admit(self, admitted: list[_Waiting]) -> None:
        """Put encoded requests (with room for them) in flight."""
        gen = self.gen
        first = len(self.live)
        self.device = admitted[0].request.src_tokens.device
        sentences: list[_Sentence] = []
        src_lengths, prefixes = [], []
        for item in admitted:
            request = item.request
            tokens, count = request.src_tokens, len(request.keys)
            src_lengths.append(_source_lengths(request, gen))
            prefix = request.prefix_tokens
            if prefix is None:
                prefix = tokens.new_empty(count, 0)
                prefix_ends = [-1] * count
            else:
                ends = prefix.eq(gen.eos)  # where a prefix forces EOS: known once, on the host
                first_end, has_end = to_host(ends.long().argmax(1), ends.any(1))
                prefix_ends = [
                    e if h else -1
                    for e, h in zip(first_end.tolist(), has_end.tolist(), strict=True)
                ]
            sentences.extend(
                _Sentence(
                    key=key,
                    src_tokens=tokens[row],
                    width=request.width,
                    max_len=request.max_len,
                    prefix_len=prefix.size(1),
                    prefix_end=prefix_ends[row],
                    nbest=NBest(self.beam, evict_worst=gen.stopping == "exact"),
                )
                for row, key in enumerate(request.keys)
            )
            prefixes.append(prefix)
        if self.model.mixes_steps:
            # Sentences with beam rows are kept in two blocks of slots, narrow ones first: the
            # attention reads each block cut to its widest source, so short sentences do not
            # read as many positions as the longest beside them: the widest of one window with
            # the narrowest of the next, or the sentences of a server (1000 random arrivals at
            # capacity 64: 276k sentence-positions per layer, 324k in one block). A sentence is
            # wide if it is more than half as wide as the widest in flight.
            widest = max(s.width for s in itertools.chain(self.live, sentences))
            for sentence in sentences:
                sentence.block = int(2 * sentence.width > widest)
        slot = first
        for outs, rows, width in _runs(admitted):
            for memory, encoder_out in zip(self.memories, outs, strict=True):
                memory.write(slot, encoder_out, rows, width)
            slot += rows.stop - rows.start
        self._add_per_sentence(first, torch.cat(src_lengths), prefixes)
        if first and self._pending is not None:
            self.refills += len(sentences)
        self.live.extend(sentences)
        self.fresh += len(sentences)
        self.tokens_in_flight += sum(self.beam * s.width for s in sentences)

    def _output_limit(self, request: Request) -> int:
        gen = self.gen
        if gen.match_source_len:
            max_len = int(to_host(_source_lengths(request, gen).max())[0])
        else:
            max_len = min(int(gen.max_len_a * request.width + gen.max_len_b), gen.max_len - 1)
        if gen.min_len > max_len:
            raise ValueError(
                f"min_len={gen.min_len} is larger than the maximum output length {max_len} "
                f"for this input (max_len_a={gen.max_len_a}, max_len_b={gen.max_len_b})"
            )
        return max_len

    def _add_per_sentence(self, first: int, src_lengths: Tensor, prefixes: list[Tensor]) -> None:
        """The new sentences' rows of the per-sentence device tensors."""
        gen = self.gen
        new = {}
        if gen.match_source_len:
            new["src_lengths"] = src_lengths
        if gen.stopping == "exact":
            new["worst"] = torch.full((len(src_lengths),), -math.inf, device=self.device)
        if gen.length_constraints is not None:
            min_a, min_b, max_a, max_b = gen.length_constraints
            new["min_lens"] = min_a * src_lengths + min_b
            new["max_lens"] = max_a * src_lengths + max_b
        if first == 0:
            self.per_sentence = {}
        if any(p.size(1) for p in prefixes) or "prefix" in self.per_sentence:
            existing = self.per_sentence.get("prefix", src_lengths.new_empty(first, 0))
            self.per_sentence["prefix"] = _stack_padded([existing, *prefixes], gen.pad)
        for name, tensor in new.items():
            old = self.per_sentence.get(name)
            self.per_sentence[name] = tensor if old is None else torch.cat([old, tensor])

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One decoder forward and search step for every sentence in flight; returns the
        sentences that finished in it."""
        if not self.live:
            return []
        gen = self.gen
        self.steps += 1
        self._advance()
        n = len(self.live)
        groups = self._attention_groups()
        encoder_outs = [memory.view(groups) for memory in self.memories]
        lprobs, attn = self.model.decode_step(
            self.tokens, encoder_outs, self.states, gen.temperature
        )
        if self.cumulative is None:  # the first step of a new batch
            self.scores = lprobs.new_zeros(n - self.one_row, 1)
            self.cumulative = lprobs.new_empty(lprobs.size(0), 0)
        if attn is not None and self.attention is None:
            self.attention = attn.new_empty(attn.size(0), 0, attn.size(1))
        lprobs, copies = self.rules.apply(lprobs, self)
        if copies is not None:
            self._copy_rows(copies)
        res = self._search(lprobs)
        status, bound = self._status(res)
        done: list[bool] | None = None
        if status.any() or any(s.step >= s.max_len for s in self.live):
            slots = res.finalize.size(1)  # beam, or fewer with a tiny vocabulary
            if status[:, slots].any():
                # fairseq's rule: NaN log-probs become -inf (rare, so only redone here)
                lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
                res = self._search(lprobs)
                status, bound = self._status(res)
            done = self._finish(res, status[:, :slots], bound, lprobs, attn)
        return self._retire(done, res, attn)

    def _search(self, lprobs: Tensor) -> BeamStep:
        """The beam step of every live sentence: those with beam rows (a batch's first step
        reads the first of them), then those with one."""
        gen, beam = self.gen, self.beam
        multi = len(self.live) - self.one_row
        steps = []
        if multi:
            hypotheses = lprobs[: multi * beam].view(multi, beam, -1)[:, : self.scores.size(1)]
            steps.append(beam_step(hypotheses, self.scores, beam, gen.eos))
        if self.one_row:
            first = lprobs[multi * beam :].unsqueeze(1)
            steps.append(beam_step(first, first.new_zeros(self.one_row, 1), beam, gen.eos))
        return steps[0] if len(steps) == 1 else concat_steps(*steps)

    def _attention_groups(self) -> list[tuple[int, int]]:
        """The live sentences as the attention reads them, (sentences, rows each): runs of
        sentences with beam rows in one width block, then those with one row."""
        multi = len(self.live) - self.one_row
        runs = itertools.groupby(self.live[:multi], lambda s: s.block)
        groups = [(len(list(run)), self.beam) for _, run in runs]
        if self.one_row:
            groups.append((self.one_row, 1))
        return groups

    def rows_of(self, sentences: list[int]) -> Tensor | None:
        """The decoder rows of live sentences ``sentences`` (None: all of them)."""
        if len(sentences) == len(self.live):
            return None
        beam, multi = self.beam, len(self.live) - self.one_row
        rows = [
            row
            for s in sentences
            for row in (range(s * beam, (s + 1) * beam) if s < multi else [s + multi * (beam - 1)])
        ]
        return to_device(rows, self.device)

    def first_rows(self) -> Tensor:
        """``[sentences]`` the first decoder row of each live sentence this step."""
        return self._layout(len(self.live), self.one_row)[0]

    def row_sentences(self) -> Tensor:
        """``[rows]`` the live sentence of each decoder row this step."""
        return self._layout(len(self.live), self.one_row)[1]

    def _layout(self, sentences: int, one_row: int) -> tuple[Tensor, Tensor]:
        """First row of each sentence and sentence of each row, when the last ``one_row`` of
        ``sentences`` have one row and the others beam (made once per shape)."""
        key = (sentences, one_row)
        if key not in self._layouts:
            multi = sentences - one_row
            counts = torch.tensor([self.beam] * multi + [1] * one_row)
            first = torch.cumsum(counts, 0) - counts
            each_row = torch.arange(sentences).repeat_interleave(counts)
            self._layouts[key] = to_device(first, self.device), to_device(each_row, self.device)
        return self._layouts[key]

    def steps_on_device(self) -> Tensor:
        """``[sentences]`` each live sentence's step, made once per step when a rule needs it."""
        if self._steps_on_device is None:
            self._steps_on_device = to_device([s.step for s in self.live], self.device)
        return self._steps_on_device

    def _advance(self) -> None:
        """Rows for this step: last step's hypotheses in their new beam order, the sentences
        that left gone, new sentences appended (BOS, zeroed state)."""
        gen, beam, fresh = self.gen, self.beam, self.fresh
        self._steps_on_device = None
        if self._pending is None:  # every sentence is new: a new batch
            n = len(self.live)
            self.one_row = n if self.model.first_step_one_row else 0
            rows = (n - self.one_row) * beam + self.one_row
            self.tokens = torch.full((rows, 1), self.bos, dtype=torch.long, device=self.device)
            self.cumulative = self.attention = self.scores = None
            self.states = [{} for _ in self.model.models]
            self.fresh = 0
            return
        res, attn, order = self._pending
        self._pending = None
        # every sentence of the last step: beam hypotheses (from one row if it had one)
        first_rows = self._layout(res.alive_beams.size(0), self.one_row)[0].unsqueeze(1)
        alive_beams, alive_tokens = res.alive_beams, res.alive_tokens
        alive_scores = res.alive_scores
        if order is not None:  # sentences left: the others in their new slots
            alive_beams, first_rows = alive_beams[order], first_rows[order]
            alive_tokens, alive_scores = alive_tokens[order], alive_scores[order]
        rows = (alive_beams + first_rows).view(-1)
        new_tokens, scores, row_scores = alive_tokens.view(-1, 1), alive_scores, alive_scores
        self.one_row = fresh if self.model.first_step_one_row else 0
        fresh_rows = self.one_row or fresh * beam
        if fresh:
            # New sentences' rows: BOS after padding, score 0. Models that decode a first step
            # in beam identical rows get one live hypothesis and beam - 1 dead copies.
            rows = torch.cat([rows, rows.new_zeros(fresh_rows)])  # placeholders, reset below
            new_tokens = torch.cat([new_tokens, new_tokens.new_full((fresh_rows, 1), self.bos)])
            if self.one_row:
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
            steps = torch.cat([_fit_width(self.attention, attn.size(1)), attn.unsqueeze(1)], 1)
            self.attention = steps.index_select(0, rows)
        history = max(s.step for s in self.live)  # tokens after BOS the longest one has
        if self.cumulative.size(1) > history:  # the longest ones left: drop their columns
            self.tokens = self.tokens[:, -(history + 1) :]
            self.cumulative = self.cumulative[:, -history:]
            if attn is not None:
                self.attention = self.attention[:, -history:]
        if fresh:
            self.tokens[-fresh_rows:, :-1] = gen.pad
        self.scores = scores
        self.model.reorder_states(self.reorderers, self.states, rows, fresh_rows)
        self.fresh = 0

    def _copy_rows(self, source: Tensor) -> None:
        """Make each row a copy of row ``source[row]`` (a forced prefix ended in EOS)."""
        self.tokens = self.tokens.index_select(0, source)
        self.cumulative = self.cumulative.index_select(0, source)
        multi, hypotheses = self.scores.shape
        if hypotheses == self.beam:  # else one score per sentence: unchanged
            self.scores = self.scores.reshape(-1)[source[: multi * hypotheses]].view_as(self.scores)

    def _status(self, res: Any) -> tuple[Tensor, Tensor | None]:
        """The one host synchronisation of a step: on the host, per live sentence, which of
        the top beam candidates end in EOS, whether the best candidate is NaN (a NaN log-prob
        would rank first: topk puts NaN on top) and, for exact stopping, whether no live
        hypothesis can beat the worst finished one; with exact stopping also that bound."""
        columns = [res.finalize, res.cand_scores[:, :1].isnan()]
        if self.gen.stopping != "exact":
            return to_host(torch.cat(columns, 1))[0], None
        bound = self._best_possible(res.alive_scores[:, 0])
        columns.append(bound.le(self.per_sentence["worst"]).unsqueeze(1))
        status, bound = to_host(torch.cat(columns, 1), bound)
        return status, bound

    def _best_possible(self, best_alive: Tensor) -> Tensor:
        """Upper bound of the final score of any continuation of the live hypotheses.

        A live hypothesis after step ``t`` has ``t + 1`` tokens; it can end with a length ``L``
        in ``[t + 2, max_len + 1]``. Log-probs are <= 0, so its summed score can only drop,
        except by the unk bonus of a negative unk penalty: ``N = best + bonus``. Its normalised
        score is ``S / lp(L)`` with ``S <= N`` and ``lp > 0`` monotone in ``L``, so
        ``S / lp(L) <= N / lp(L)``, which is largest at one end of the length range:
        ``N / max(lp)`` when ``N <= 0``, else ``N / min(lp)``.
        """
        gen = self.gen
        unk_bonus = max(0.0, -gen.unk_penalty)
        if unk_bonus:
            bonus = [unk_bonus * (s.max_len - s.step) for s in self.live]
            best_alive = best_alive + to_device(bonus, self.device, best_alive.dtype)
        if not gen.normalize_scores:
            return best_alive
        ends = [
            [
                length_normaliser(length, gen.len_penalty, gen.length_penalty_style)
                for length in (s.step + 2, s.max_len + 1)
            ]
            for s in self.live
        ]
        low, high = to_device(ends, self.device, best_alive.dtype).unbind(1)
        return torch.where(best_alive > 0, best_alive / low.minimum(high),
                           best_alive / low.maximum(high))

    def _finish(
        self,
        res: Any,
        finalize: Tensor,
        bound: Tensor | None,
        lprobs: Tensor,
        attn: Tensor | None,
    ) -> list[bool]:
        """Store the hypotheses that end now (``finalize``: the host copy of res.finalize) and
        return, per live sentence, whether it is done."""
        gen, beam = self.gen, self.beam
        sents, slots = finalize.nonzero(as_tuple=True)
        if len(sents):
            sents_dev, cands = to_device(
                torch.stack([sents, sents * res.cand_beams.size(1) + slots]), self.device
            )
            rows = self.first_rows().index_select(0, sents_dev)
            rows = rows + res.cand_beams.view(-1).index_select(0, cands)
            eos_scores = res.cand_scores.view(-1).index_select(0, cands)
            self._store(sents.tolist(), sents_dev, rows, eos_scores, attn)
        counts = [len(s.nbest) for s in self.live]
        at_max = [s.step >= s.max_len for s in self.live]
        if gen.stopping == "fairseq":
            done = [m or c >= beam for m, c in zip(at_max, counts, strict=True)]
        else:
            worst = torch.tensor([s.nbest.worst_score() for s in self.live])
            self.per_sentence["worst"] = to_device(worst.to(bound.dtype), self.device)
            done = [m or b for m, b in zip(at_max, bound.le(worst).tolist(), strict=True)]
        empty = [i for i, d in enumerate(done) if d and counts[i] == 0]
        if empty:
            # Nothing reached EOS: the live hypotheses, with EOS appended, are the answer
            # (beam of them, as in fairseq, even at the first step where all are the same).
            sents = torch.tensor(empty).repeat_interleave(beam)
            hypos = torch.arange(beam).repeat(len(empty))
            # a sentence at its first step has one row, one hypothesis, score 0
            own = hypos.masked_fill(sents >= len(self.live) - self.one_row, 0)
            sents_dev, own_dev = to_device(torch.stack([sents, own]), self.device)
            rows = self.first_rows().index_select(0, sents_dev) + own_dev
            scores = F.pad(self.scores, (0, 0, 0, self.one_row))
            cumulative = scores[sents_dev, own_dev % scores.size(1)] + lprobs[rows, gen.eos]
            self._store(sents.tolist(), sents_dev, rows, cumulative, attn)
        return done

    def _store(
        self,
        sents: list[int],
        sents_dev: Tensor,
        rows: Tensor,
        eos_cumulative: Tensor,
        attn: Tensor | None,
    ) -> None:
        """Give the n-best keepers of sentences ``sents`` (``sents_dev`` the same on the device)
        the hypotheses of rows ``rows`` followed by EOS."""
        gen = self.gen
        lengths = [self.live[s].step + 1 for s in sents]  # tokens, EOS included
        eos = torch.full_like(rows, gen.eos).unsqueeze(1)
        tokens = torch.cat([self.tokens.index_select(0, rows), eos], 1)
        cumulative = torch.cat([self.cumulative.index_select(0, rows), eos_cumulative[:, None]], 1)
        # A row's own columns are its last `length`; the one before them is the score 0 its
        # sentence joined with (or F.pad's 0), so differences are its positional scores.
        positional = cumulative - F.pad(cumulative[:, :-1], (1, 0))
        scores = eos_cumulative
        if gen.normalize_scores:
            divisors = [
                length_normaliser(n, gen.len_penalty, gen.length_penalty_style) for n in lengths
            ]
            if len(set(lengths)) == 1:  # one length (always, batch after batch): a number
                scores = scores / divisors[0]
            else:
                scores = scores / to_device(divisors, self.device, scores.dtype)
        if gen.match_source_len:
            src_lengths = self.per_sentence["src_lengths"].index_select(0, sents_dev)
            too_long = to_device(lengths, self.device) > src_lengths + 1
            scores = scores.masked_fill(too_long, -math.inf)
        fetched = [tokens, positional, scores]
        if attn is not None:
            history = _fit_width(self.attention, attn.size(1)).index_select(0, rows)
            history = torch.cat([history, attn.index_select(0, rows).unsqueeze(1)], 1)
            fetched.append(history.transpose(1, 2))
        # Returned tensors must be ordinary ones: callers change them in place
        # (fairseq-generate divides the positional scores by log 2).
        with torch.inference_mode(False):
            fetched = [t.clone().unbind() for t in to_host(*fetched)]  # one view per row
        for sent, length, tokens, positional, score, *attention in zip(
            sents, lengths, *fetched, strict=True
        ):
            own = slice(-length, None)  # the columns of longer rows come first
            source = slice(-self.live[sent].width, None)
            self.live[sent].nbest.add(
                {
                    "tokens": tokens[own],
                    "score": score,
                    "attention": attention[0][source, own] if attention else torch.empty(0),
                    "alignment": torch.empty(0),
                    "positional_scores": positional[own],
                }
            )

    # ---- retiring --------------------------------------------------------------------------

    def _retire(self, done: list[bool] | None, res: Any, attn: Tensor | None) -> list[Finished]:
        """Hand back the finished sentences; later ones move into their slots, and those at
        their first step into their width block."""
        order_dev = None
        done = done or [False] * len(self.live)
        finished = [self._result(s) for s, d in zip(self.live, done, strict=True) if d]
        kept = order = list(range(len(self.live)))
        if finished or self.one_row:  # some left, or some join their width block
            blocks = [None if d else s.block for s, d in zip(self.live, done, strict=True)]
            order = _arrangement(blocks)
        if order != kept:
            self.live = [self.live[old] for old in order]
            self.tokens_in_flight = sum(self.beam * s.width for s in self.live)
            if self.live:
                for memory in self.memories:
                    memory.rearrange(order)
                order_dev = to_device(order, self.device)
                for name, tensor in self.per_sentence.items():
                    self.per_sentence[name] = tensor.index_select(0, order_dev)
        for sentence in self.live:
            sentence.step += 1
        self._pending = _Pending(res, attn, order_dev) if self.live else None
        return finished

    def _result(self, sentence: _Sentence) -> Finished:
        hypotheses = sentence.nbest.best_first(self.gen.nbest)
        if self.gen.print_alignment:
            self.gen.add_alignments(hypotheses, sentence.src_tokens)
        return Finished(sentence.key, hypotheses)


@dataclass(eq=False)
class _Waiting:
    """A request waiting for room, and once encoded, where its encoder output is."""

    request: Request
    since: int  # the engine's step count when it came
    group: list[_Waiting] | None = None  # the requests it is to be encoded with, once planned
    encoded: _Encoded | None = None


class _Encoded(NamedTuple):
    outs: list[Any]  # per model, the encoder output of the request's group
    rows: slice  # the request's rows in it


def _similar_widths(waiting: list[_Waiting]) -> list[list[_Waiting]]:
    """``waiting`` in the groups that cost the encoder least, narrowest first: a group costs
    ENCODER_FORWARD_TOKENS plus its rows times its widest source. The best split of the requests
    sorted by width into runs is found over their distinct widths (dynamic programming, few
    widths); within a group, by width, requests of one width in the order of ``waiting``."""
    rows_at: dict[int, int] = {}
    for item in waiting:
        rows_at[item.request.width] = rows_at.get(item.request.width, 0) + len(item.request.keys)
    widths = sorted(rows_at)
    # cost[j]: of encoding the requests of widths[:j]; start[j]: where its last group starts
    cost, start = [0], [0]
    for j, width in enumerate(widths, 1):
        rows, best, first = 0, math.inf, 0
        for i in range(j - 1, -1, -1):  # the last group: widths[i:j]
            rows += rows_at[widths[i]]
            group_cost = cost[i] + ENCODER_FORWARD_TOKENS + rows * width
            if group_cost < best:
                best, first = group_cost, i
        cost.append(best)
        start.append(first)
    group_of: dict[int, int] = {}
    j = len(widths)
    while j:
        for width in widths[start[j] : j]:
            group_of[width] = start[j]
        j = start[j]
    groups: dict[int, list[_Waiting]] = {first: [] for first in sorted(set(group_of.values()))}
    for item in sorted(waiting, key=lambda w: w.request.width):
        groups[group_of[item.request.width]].append(item)
    return list(groups.values())


def _runs(admitted: list[_Waiting]) -> Iterator[tuple[list[Any], slice, int]]:
    """Consecutive requests that are consecutive rows of one encoder output, as one block:
    (the encoder outputs, the rows, the widest source among them)."""
    block: list[_Waiting] = []
    for item in admitted:
        if block and not (
            item.encoded.outs is block[-1].encoded.outs
            and item.encoded.rows.start == block[-1].encoded.rows.stop
        ):
            yield _block(block)
            block = []
        block.append(item)
    if block:
        yield _block(block)


def _block(block: list[_Waiting]) -> tuple[list[Any], slice, int]:
    rows = slice(block[0].encoded.rows.start, block[-1].encoded.rows.stop)
    return block[0].encoded.outs, rows, max(item.request.width for item in block)


class _Pending(NamedTuple):
    """A step's result, applied to the decoder rows at the start of the next step (so that
    sentences admitted in between join in the same reorder)."""

    res: Any  # the BeamStep
    attn: Tensor | None  # the step's attention
    order: Tensor | None  # old slot of each sentence that stays, if some left


def _source_lengths(request: Request, gen: SequenceGenerator) -> Tensor:
    """The request's source lengths, or what fairseq's generator counts without them: the
    tokens but EOS and padding."""
    if request.src_lengths is not None:
        return request.src_lengths
    tokens = request.src_tokens
    return (tokens.ne(gen.eos) & tokens.ne(gen.pad)).long().sum(1)


def _arrangement(blocks: list[int | None]) -> list[int]:
    """The slots of the sentences that stay (``blocks[slot]``: a sentence's block, None if it
    leaves), grouped by block in ascending order: ``order[slot] = old slot``. As few as possible
    move: those already in their block's new range keep their slot, the others fill its holes
    in their order."""
    counts = Counter(block for block in blocks if block is not None)
    ranges, start = {}, 0
    for block in sorted(counts):
        ranges[block] = range(start, start + counts[block])
        start += counts[block]
    order: list[int | None] = [None] * start
    movers: dict[int, list[int]] = {block: [] for block in ranges}
    for old, block in enumerate(blocks):
        if block is None:
            continue
        if old in ranges[block]:
            order[old] = old
        else:
            movers[block].append(old)
    for block, olds in movers.items():
        holes = (slot for slot in ranges[block] if order[slot] is None)
        for slot, old in zip(holes, olds, strict=False):
            order[slot] = old
    return order


def _fit_width(history: Tensor, width: int) -> Tensor:
    """``history`` ``[rows, steps, src]`` left-padded with zeros or cut on the left to
    ``width`` source positions (the memory pool widened or narrowed)."""
    src = history.size(2)
    if src == width:
        return history
    if src > width:
        return history[:, :, src - width :]
    return F.pad(history, (width - src, 0))


def _stack_padded(blocks: list[Tensor], pad: int, left: bool = False) -> Tensor:
    """``[rows, width]`` blocks stacked, padded with ``pad`` to the widest (on the left or the
    right)."""
    if len(blocks) == 1:
        return blocks[0]
    width = max(b.size(1) for b in blocks)
    padded = [
        F.pad(b, (width - b.size(1), 0) if left else (0, width - b.size(1)),
                                value=pad)
        for b in blocks
    ]
    return torch.cat(padded)

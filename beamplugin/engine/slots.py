"""The slots of the sentences in flight: one per sentence, and its decoder rows.

Sentences are laid out sentence-major: ``beam`` decoder rows each, except sentences at their
first step where every model reads the encoder output per sentence (one row each; they come
last). Sentences with beam rows are kept in two width blocks, narrow ones first, so that the
attention reads each block cut to its widest source. Each model's encoder memory keeps a
sentence in its slot until it leaves (``allocate`` writes the new ones after the others,
``free`` moves as few as possible into the holes of those that left), and so do the
per-sentence tensors the search reads on the device.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.engine.ensemble import EncoderMemory, EnsembleDecoder
from beamplugin.engine.scheduler import Waiting
from beamplugin.modules.output_columns import OutputColumns, shortlist_columns
from beamplugin.runtime.host_transfer import to_device, to_host
from beamplugin.search.constraints import Progress, initial_progress
from beamplugin.search.log_prob_rules import StepView
from beamplugin.search.nbest import NBest
from beamplugin.search.options import DecodingOptions


@dataclass(eq=False)
class Sentence:
    """Host-side record of a sentence in flight."""

    key: Any
    src_tokens: Tensor  # its row of the request, padding included
    width: int  # of its request: the source length fairseq's max_len_a and attention see
    max_len: int  # output tokens before EOS is forced
    prefix_len: int  # steps its forced prefix covers (its request's prefix width)
    prefix_end: int  # step at which its prefix forces EOS, -1 if none does
    nbest: NBest
    bos: int | None = None  # its request's first token (None: the engine's)
    shortlist: Tensor | None = None  # the tokens it may take, ascending (None: any)
    step: int = 0  # output tokens it has
    block: int = 0  # its width block among the sentences with beam rows
    cancelled: bool = False  # leaves at the end of the next step, with no result
    # its hypotheses' progress through its lexical constraints (None: it has none)
    constraints: Progress | None = None
    error: Exception | None = None  # why it has no result (its constraints were not met)


class Slots:
    """The sentences in flight, their slots in the models' encoder memories, their decoder rows
    and their per-sentence tensors on the device."""

    def __init__(self, model: EnsembleDecoder, options: DecodingOptions) -> None:
        self.options = options
        self.beam = options.beam_size
        self.mixes_steps = model.mixes_steps
        self.first_step_one_row = model.first_step_one_row
        self.memories: list[EncoderMemory] = model.encoder_memories(self.beam)
        self.live: list[Sentence] = []
        self.device: torch.device | None = None
        self.tokens_in_flight = 0  # beam x source width, summed over the live sentences
        self.fresh = 0  # the last `fresh` live sentences were allocated since the last step
        self.one_row = 0  # the last `one_row` live sentences have one row this step
        # "src_lengths" (match_source_len), "worst" (exact stopping), "min_lens" and
        # "max_lens" (length constraints), "prefix" (forced prefixes)
        self.per_sentence: dict[str, Tensor] = {}
        self._layouts: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._steps_on_device: Tensor | None = None
        self._memory_views: list[Any] | None = None  # while no sentence comes, goes or widens
        self._columns: OutputColumns | None = None  # per sentence, while no sentence comes or goes

    # ---- allocate and free ---------------------------------------------------------------

    def allocate(self, admitted: list[Waiting]) -> list[Sentence]:
        """Give the encoded requests ``admitted`` the slots after the live sentences."""
        options = self.options
        first = len(self.live)
        self.device = admitted[0].request.src_tokens.device
        sentences: list[Sentence] = []
        src_lengths, prefixes = [], []
        for item in admitted:
            request = item.request
            tokens, count = request.src_tokens, len(request.keys)
            src_lengths.append(request.source_lengths(options))
            prefix = request.prefix_tokens
            if prefix is None:
                prefix = tokens.new_empty(count, 0)
                prefix_ends = [-1] * count
            else:
                ends = prefix.eq(options.eos)  # where a prefix forces EOS: known once, on the host
                first_end, has_end = to_host(ends.long().argmax(1), ends.any(1))
                prefix_ends = [
                    e if h else -1
                    for e, h in zip(first_end.tolist(), has_end.tolist(), strict=True)
                ]
            shortlists = self._shortlists(tokens, prefix)
            constraints = request.constraints or [None] * count
            sentences.extend(
                Sentence(
                    key=key,
                    src_tokens=tokens[row],
                    width=request.width,
                    max_len=request.max_len,
                    prefix_len=prefix.size(1),
                    prefix_end=prefix_ends[row],
                    nbest=NBest(self.beam, evict_worst=options.stopping == "exact"),
                    bos=request.bos,
                    shortlist=shortlists[row],
                    constraints=initial_progress(constraints[row], options.constraints)
                    if constraints[row] else None,
                )
                for row, key in enumerate(request.keys)
            )
            prefixes.append(prefix)
        if self.mixes_steps:
            # A sentence is wide if it is more than half as wide as the widest in flight.
            widest = max(s.width for s in itertools.chain(self.live, sentences))
            for sentence in sentences:
                sentence.block = int(2 * sentence.width > widest)
        slot = first
        for block in _runs(admitted):
            slot += self._write(slot, block)
        self._add_per_sentence(first, torch.cat(src_lengths), prefixes)
        self.live.extend(sentences)
        self._memory_views = self._columns = None
        self.fresh += len(sentences)
        self.tokens_in_flight += sum(self.beam * s.width for s in sentences)
        return sentences

    def _write(self, slot: int, block: list[Waiting]) -> int:
        """Write a block of requests' encoder output into the memories from ``slot`` on, and let
        the requests release it: each group's output is freed once all of it is written, not
        when the whole admission is (at big size, 64 sentences, 120 MB of outputs beside the
        pools); the number of sentences written."""
        outs, rows, width = _block(block)
        for memory, encoder_out in zip(self.memories, outs, strict=True):
            memory.write(slot, encoder_out, rows, width)
        for item in block:
            item.release()
        return rows.stop - rows.start

    def _shortlists(self, src_tokens: Tensor, prefix: Tensor) -> list[Tensor | None]:
        """Per row of a request's ``src_tokens`` and forced ``prefix``, the tokens that sentence
        may take (None: any)."""
        vocabulary_map, pad = self.options.shortlist, self.options.pad
        if vocabulary_map is None:
            return [None] * src_tokens.size(0)
        sources, forced = to_host(src_tokens, prefix)
        return [
            vocabulary_map.shortlist(source[source.ne(pad)].tolist(), own[own.ne(pad)].tolist())
            for source, own in zip(sources, forced, strict=True)
        ]

    def _add_per_sentence(self, first: int, src_lengths: Tensor, prefixes: list[Tensor]) -> None:
        """The new sentences' rows of the per-sentence device tensors."""
        options = self.options
        new = {}
        if options.match_source_len:
            new["src_lengths"] = src_lengths
        if options.stopping == "exact":
            new["worst"] = torch.full((len(src_lengths),), -math.inf, device=self.device)
        if options.length_constraints is not None:
            min_a, min_b, max_a, max_b = options.length_constraints
            new["min_lens"] = min_a * src_lengths + min_b
            new["max_lens"] = max_a * src_lengths + max_b
        if first == 0:
            self.per_sentence = {}
        if any(p.size(1) for p in prefixes) or "prefix" in self.per_sentence:
            existing = self.per_sentence.get("prefix", src_lengths.new_empty(first, 0))
            self.per_sentence["prefix"] = stack_padded([existing, *prefixes], options.pad)
        for name, tensor in new.items():
            old = self.per_sentence.get(name)
            self.per_sentence[name] = tensor if old is None else torch.cat([old, tensor])

    def free(self, done: list[bool] | None) -> Tensor | None:
        """Free the slots of the sentences ``done``; later ones move into their slots, and
        those at their first step into their width block. Every sentence that stays takes a
        step. Returns the old slot of each sentence that stays, if any moved (on the device)."""
        done = done or [False] * len(self.live)
        kept = order = list(range(len(self.live)))
        if any(done) or self.one_row:  # some left, or some join their width block
            blocks = [None if d else s.block for s, d in zip(self.live, done, strict=True)]
            order = arrangement(blocks)
        order_dev = None
        if order != kept:
            self._memory_views = self._columns = None
            self.live = [self.live[old] for old in order]
            self.tokens_in_flight = sum(self.beam * s.width for s in self.live)
            for memory in self.memories:  # none staying: the memories let go of all
                memory.rearrange(order)
            if self.live:
                order_dev = to_device(order, self.device)
                for name, tensor in self.per_sentence.items():
                    self.per_sentence[name] = tensor.index_select(0, order_dev)
        for sentence in self.live:
            sentence.step += 1
        return order_dev

    # ---- this step's rows ----------------------------------------------------------------

    def start_step(self) -> int:
        """Lay out this step's rows: the sentences allocated since the last step have one row
        each where the models allow it. Returns how many were allocated."""
        fresh, self.fresh = self.fresh, 0
        if self.one_row:  # last step's one-row sentences have beam rows now
            self._memory_views = None
        self.one_row = fresh if self.first_step_one_row else 0
        self._steps_on_device = None
        return fresh

    def attention_groups(self) -> list[tuple[int, int]]:
        """The live sentences as the attention reads them, (sentences, rows each): runs of
        sentences with beam rows in one width block, then those with one row."""
        multi = len(self.live) - self.one_row
        runs = itertools.groupby(self.live[:multi], lambda s: s.block)
        groups = [(len(list(run)), self.beam) for _, run in runs]
        if self.one_row:
            groups.append((self.one_row, 1))
        return groups

    def memory_views(self) -> list[Any]:
        """Per model, the encoder output its decoder reads this step (the same objects from
        step to step while the sentences in flight and their rows stay)."""
        if self._memory_views is None:
            groups = self.attention_groups()
            self._memory_views = [memory.view(groups) for memory in self.memories]
        return self._memory_views

    def output_columns(self) -> OutputColumns | None:
        """The vocabulary columns each row may take this step (None: every one)."""
        if self.options.shortlist is None:
            return None
        if self._columns is None:
            shortlists = [s.shortlist for s in self.live]
            self._columns = shortlist_columns(shortlists, self.device)
        return self._columns.for_rows(self.row_sentences())

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
        return self.layout(len(self.live), self.one_row)[0]

    def row_sentences(self) -> Tensor:
        """``[rows]`` the live sentence of each decoder row this step."""
        return self.layout(len(self.live), self.one_row)[1]

    def layout(self, sentences: int, one_row: int) -> tuple[Tensor, Tensor]:
        """First row of each sentence and sentence of each row, when the last ``one_row`` of
        ``sentences`` have one row and the others beam (made once per shape)."""
        key = (sentences, one_row)
        if key not in self._layouts:
            multi = sentences - one_row
            counts = [self.beam] * multi + [1] * one_row
            first = [0, *itertools.accumulate(counts)][:-1]
            each_row = [s for s, count in enumerate(counts) for _ in range(count)]
            # made on the host and copied in one: a new shape comes with most retirements,
            # where on a GPU each small tensor operation costs more than its arithmetic
            both = to_device(first + each_row, self.device, torch.long)
            self._layouts[key] = both[:sentences], both[sentences:]
        return self._layouts[key]

    def steps_on_device(self) -> Tensor:
        """``[sentences]`` each live sentence's step, made once per step when a rule needs it."""
        if self._steps_on_device is None:
            self._steps_on_device = to_device([s.step for s in self.live], self.device)
        return self._steps_on_device

    def view(self, tokens: Tensor) -> StepView:
        """What the log-prob rules see of this step, the rows' histories being ``tokens``."""
        live = self.live
        return StepView(
            tokens=tokens,
            steps=[s.step for s in live],
            max_lens=[s.max_len for s in live],
            prefix_lens=[s.prefix_len for s in live],
            prefix_ends=[s.prefix_end for s in live],
            layout=self,
            per_sentence=self.per_sentence,
        )


def _runs(admitted: list[Waiting]) -> Iterator[list[Waiting]]:
    """Consecutive requests that are consecutive rows of one encoder output, as one block."""
    block: list[Waiting] = []
    for item in admitted:
        if block and not (
            item.encoded.outs is block[-1].encoded.outs
            and item.encoded.rows.start == block[-1].encoded.rows.stop
        ):
            yield block
            block = []
        block.append(item)
    if block:
        yield block


def _block(block: list[Waiting]) -> tuple[list[Any], slice, int]:
    """A block's encoder outputs, its rows in them and the widest source among them."""
    rows = slice(block[0].encoded.rows.start, block[-1].encoded.rows.stop)
    return block[0].encoded.outs, rows, max(item.request.width for item in block)


def arrangement(blocks: list[int | None]) -> list[int]:
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


def stack_padded(blocks: list[Tensor], pad: int, left: bool = False) -> Tensor:
    """``[rows, width]`` blocks stacked, padded with ``pad`` to the widest (on the left or the
    right)."""
    if len(blocks) == 1:
        return blocks[0]
    width = max(b.size(1) for b in blocks)
    padded = [
        F.pad(b, (width - b.size(1), 0) if left else (0, width - b.size(1)), value=pad)
        for b in blocks
    ]
    return torch.cat(padded)

"""The encoder memory of the sentences in flight, one slot per sentence, for a decoder that mixes
sentences of different steps in one forward (see beamplugin.engine.ensemble).

A memory is a dict of tensors whose first dimension is the sentence, as an encoder prepares it
for its decoder's attention (keys, values, a padding bias, ...); a :class:`Layout` says, per
tensor, which dimension holds the source positions and what padding holds there. Slots are rows
of preallocated tensors, all as wide as the widest source in flight, shorter ones left-padded.
A new sentence is written into its slot, a leaving one is replaced by moving a later sentence
into its slot: no step copies the whole pool. The pool widens when a longer source arrives and
narrows once the sources in flight need less than half its width. The decoder reads it in
groups of consecutive slots, each cut to the widest source among them: the attention products
grow with the positions they read.

Widths are multiples of :data:`LANES` positions: torch's CPU reductions over a row (the
softmax's sum) run in vectors of at most that many lanes, so with the row's own positions last
and its width a multiple of the lanes, each position meets the same lanes in the same order
however much padding precedes it, and a sentence's attention has the same bits alone or
batched (padding adds exact zeros). And a pool reads at least :func:`least_width` positions:
torch computes a product of fewer than :data:`NAIVE_PRODUCTS` multiply-adds per matrix in a
loop of its own, which rounds differently from the BLAS kernel that larger ones take, so a
sentence's attention would change bits when a batch-mate's longer source widens the read.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from beamplugin.runtime import pages
from beamplugin.runtime.host_transfer import to_device

Memory = dict[str, Tensor | None]

LANES = 16  # float32 lanes of AVX512 (AVX2's 8 divide it)
NAIVE_PRODUCTS = 400  # torch's batched products below this many multiply-adds: its own loop


def lane_width(width: int) -> int:
    """``width`` rounded up to a multiple of :data:`LANES`."""
    return -(-width // LANES) * LANES


def least_width(inner: int) -> int:
    """The fewest positions an attention of one query row over ``inner``-wide keys reads
    (lane-wide), so that its products (query x keys, weights x values) take the BLAS kernel
    whatever the width: only attention heads narrower than 25 need more than :data:`LANES`."""
    return lane_width(-(-NAIVE_PRODUCTS // inner))


class Pooled(NamedTuple):
    """How a pool keeps one tensor of a memory (dimension 0: the sentence)."""

    width_dim: int | None  # the source positions (left-padded), None if it has none
    padding: float  # what padding positions hold
    # a tensor an encoder may leave out (None: no padding anywhere), made of ones then zeros
    # as (sentences, 1, ..., width) of this many dimensions; 0: always given
    optional_rank: int = 0


Layout = dict[str, Pooled]


class MemoryPool:
    """The pool of a memory whose attention reads ``inner``-wide keys. ``padded``: the encoder
    output holds the layout's padding at every position before a sentence's own, so a sentence's
    rows can be read wider than its own width (a new batch's memory is then a view of them)."""

    def __init__(self, layout: Layout, inner: int, padded: bool = False) -> None:
        self.layout = layout
        self.least = least_width(inner)
        self.padded = padded
        self.memory: Memory = {}
        self.widths: list[int] = []  # per live slot: its source width (own padding included)
        # views made since the slots last changed, by groups: most steps at a small capacity
        # neither admit nor retire a sentence
        self._views: dict[tuple[tuple[int, int], ...], dict] = {}

    @property
    def width(self) -> int:
        """The source positions of every slot (0 while empty)."""
        if not self.memory:
            return 0
        name, tensor = self._reference()
        return tensor.size(self.layout[name].width_dim)

    def _reference(self) -> tuple[str, Tensor]:
        """A tensor of the memory that has source positions."""
        return next(
            (name, t) for name, t in self.memory.items()
            if t is not None and self.layout[name].width_dim is not None
        )  # fmt: skip

    def write(self, first_slot: int, encoder_out: dict, rows: slice, width: int) -> None:
        """Put rows ``rows`` of ``encoder_out`` (sources of at most ``width`` positions, the
        last ones: sources are left-padded) at slots ``first_slot`` on."""
        self._views.clear()
        source = encoder_out["attention_memory"]
        count = rows.stop - rows.start
        if first_slot == 0:  # a new batch
            self.memory, self.widths = {}, []
        self.widths = self.widths[:first_slot] + [width] * count
        taken = width  # the source positions taken: its own, or as many as the pool reads
        width = self._read_width(self.widths)
        if first_slot == 0 and self.padded:
            taken = min(width, new_width(source, self.layout))
        new = narrowed(source, self.layout, rows, taken)
        if first_slot == 0 and taken == width:
            # its memory becomes the pool, a view of these rows of the encoder output: the pool
            # changes them in place only for the sentences they belong to (sentences still
            # waiting read other rows)
            self.memory = new
            return
        capacity = self._reference()[1].size(0) if self.memory else count
        if capacity < first_slot + count:
            capacity = 2 * (first_slot + count)  # room to grow without reallocating each time
        if (
            not self.memory
            or any(t is None for t in self.memory.values())
            or self.width != width
            or capacity != self._reference()[1].size(0)
        ):
            self._reallocate(first_slot, capacity, width, new)
        slots = slice(first_slot, first_slot + count)
        pad = width - new_width(new, self.layout)
        for name, spec in self.layout.items():
            pool, given = self.memory[name], new[name]
            if spec.width_dim is None:
                pool[slots] = given
                continue
            # a tensor left out (no padding in its source) holds zeros at its own positions
            before = (slots, *[slice(None)] * (spec.width_dim - 1))
            pool[(*before, slice(None, pad))] = spec.padding
            pool[(*before, slice(pad, None))] = 0 if given is None else given

    def _reallocate(self, live: int, capacity: int, width: int, like: Memory) -> None:
        """New tensors of ``capacity`` slots and ``width``; the first ``live`` slots kept. An
        empty pool takes its tensors' shapes from ``like`` (a memory to be written)."""
        old, kept = self.memory or like, min(width, self.width)
        reference = next(t for t in old.values() if t is not None)
        self.memory = {}
        for name, spec in self.layout.items():
            tensor = old[name]
            if tensor is None:
                shape = (capacity, *[1] * (spec.optional_rank - 2), width)
                new = reference.new_full(shape, spec.padding)
                new[:live, ..., width - kept :] = 0
            elif spec.width_dim is None:
                new = tensor.new_zeros(capacity, *tensor.shape[1:])
                new[:live] = tensor[:live]
            else:
                shape = list(tensor.shape)
                shape[0], shape[spec.width_dim] = capacity, width
                # zeros take memory only where written: the room to grow costs none until used
                if spec.padding == 0:
                    new = pages.zeros(shape, tensor)
                else:
                    new = tensor.new_full(shape, spec.padding)
                before = (slice(None, live), *[slice(None)] * (spec.width_dim - 1))
                source = tensor.size(spec.width_dim)
                new[(*before, slice(width - kept, None))] = tensor[
                    (*before, slice(source - kept, None))
                ]
            self.memory[name] = new

    def rearrange(self, order: list[int]) -> None:
        """Keep the sentences of slots ``order``, now at slots ``0 .. len(order) - 1``; none:
        let go of the whole memory."""
        self._views.clear()
        if not order:  # the last sentences left: nothing kept beside the next batch's encoding
            self.memory, self.widths = {}, []
            return
        moved = [(slot, old) for slot, old in enumerate(order) if slot != old]
        self.widths = [self.widths[old] for old in order]
        if moved:
            device = self._reference()[1].device
            slots, olds = to_device(list(zip(*moved, strict=True)), device)
            for tensor in self.memory.values():
                if tensor is not None:
                    tensor.index_copy_(0, slots, tensor.index_select(0, olds))
        if self.widths and 2 * self._read_width(self.widths) <= self.width:
            capacity = self._reference()[1].size(0)
            self._reallocate(len(order), capacity, self._read_width(self.widths), self.memory)

    def _read_width(self, widths: list[int]) -> int:
        """What the attention reads of sources ``widths`` wide."""
        return lane_width(max(max(widths), self.least))

    def view(self, groups: list[tuple[int, int]]) -> dict:
        """The encoder output that the decoder reads: for each group of slots, from the first
        on, (sentences, decoder rows each), their memory cut to the widest of them."""
        key = tuple(groups)
        if key not in self._views:
            attention_groups, slot = [], 0
            for sentences, rows_each in groups:
                slots = slice(slot, slot + sentences)
                width = self._read_width(self.widths[slots])
                memory = narrowed(self.memory, self.layout, slots, width)
                attention_groups.append((memory, sentences * rows_each))
                slot += sentences
            self._views[key] = {"attention_groups": attention_groups}
        return self._views[key]


def narrowed(memory: Memory, layout: Layout, rows: slice, width: int) -> Memory:
    """Rows ``rows`` of a memory, cut to its last ``width`` source positions (the tensors
    themselves where they are no more: a sentence alone reads its memory as the pool took it)."""
    out: Memory = {}
    for name, spec in layout.items():
        tensor = memory[name]
        if tensor is not None:
            if rows != slice(0, tensor.size(0)):
                tensor = tensor[rows]
            if spec.width_dim is not None and tensor.size(spec.width_dim) != width:
                start = tensor.size(spec.width_dim) - width
                tensor = tensor.narrow(spec.width_dim, start, width)
        out[name] = tensor
    return out


def new_width(memory: Memory, layout: Layout) -> int:
    """The source positions of a memory."""
    return next(
        t.size(layout[name].width_dim) for name, t in memory.items()
        if t is not None and layout[name].width_dim is not None
    )  # fmt: skip

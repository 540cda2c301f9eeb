"""The device side of the device engine (beamplugin.engine.device_engine): fixed-capacity rows
for the decoder and the search, the step that runs on them, one CUDA graph per bucket, and the
copies to the host that the engine reads a step late.

Capacities (sentence slots, token columns, source positions) are powers of two and grow, never
shrink; a step runs a bucket (slots, columns, sources): the powers of two that hold what is in
flight. Each bucket's step is captured as a CUDA graph the second time it is needed (the first
run, eager, warms up the libraries it calls) and replayed from then on. A capacity that grows
makes new buffers, so the graphs are captured again. Everything here runs on one stream of its
own, so the host's copies and writes between steps are ordered with the steps.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.engine.ensemble import EnsembleDecoder, search_log_probs
from beamplugin.models import fixed_rows_convs2s, fixed_rows_transformer
from beamplugin.runtime.host_transfer import to_device
from beamplugin.search import fixed_rows_step
from beamplugin.search.fixed_rows_step import ENDED, ROW, SLOT, Rules, SearchState
from beamplugin.search.options import DecodingOptions

logger = logging.getLogger(__name__)

LEAST_COLUMNS = 16  # the narrowest bucket of token columns and of source positions


def serves(model: object) -> bool:
    """Whether fixed rows decode ``model`` (one of an ensemble's models, as the engine sees it:
    a fairseq transformer, or our convs2s)."""
    return fixed_rows_transformer.serves(model) or fixed_rows_convs2s.serves(model)


def _decoder_state(model: object) -> type:
    if fixed_rows_transformer.serves(model):
        return fixed_rows_transformer.FixedRowsTransformer
    return fixed_rows_convs2s.FixedRowsConvS2S


class Capacity(NamedTuple):
    """Room for ``slots`` sentences, ``columns`` token columns a row, ``sources`` source
    positions a sentence and forced prefixes of ``prefix`` tokens."""

    slots: int
    columns: int
    sources: int
    prefix: int


class Bucket(NamedTuple):
    """What a step runs: the first ``slots`` sentence slots, ``columns`` token columns a row
    (positions 0 .. columns - 1) and ``sources`` source positions."""

    slots: int
    columns: int
    sources: int


class HostCopy(NamedTuple):
    """Tensors copied to the host without waiting; ``ready()`` waits for them."""

    tensors: list[Tensor]
    event: Any  # a CUDA event recorded after the copies, or None on the CPU

    def ready(self) -> list[Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


class EndedRows(NamedTuple):
    """The n-best rows of retired sentences, on the host: per sentence ``beam`` rows."""

    counts: Tensor  # [sentences]
    tokens: Tensor  # [sentences x beam, columns + 1]
    cumulative: Tensor  # [sentences x beam, columns + 1]
    scores: Tensor  # [sentences x beam]
    lengths: Tensor  # [sentences x beam]


class FixedRows:
    """The rows of ``model`` (one fairseq transformer or convs2s) and of the search with
    ``options`` on ``device``; steps as CUDA graphs where ``graphs`` and the device is a
    GPU."""

    def __init__(
        self, model: EnsembleDecoder, options: DecodingOptions, device: torch.device,
        graphs: bool,
    ) -> None:  # fmt: skip
        self.view = model.models[0]
        self.options = options
        self.beam = options.beam_size
        self.device = device
        self.dtype = next(self.view.parameters()).dtype
        self.capacity = Capacity(0, 0, 0, 0)
        self.decoder: Any = None  # the model's fixed-rows state (beamplugin.models.fixed_rows_*)
        self.search: SearchState | None = None
        self.rules: Rules | None = None
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.graphs_on = graphs and cuda
        self._pool = torch.cuda.graph_pool_handle() if self.graphs_on else None
        self._graphs: dict[Bucket, Any] = {}
        self._warm: set[Bucket] = set()
        self._eager: set[Bucket] = set()  # buckets whose capture failed: run eagerly
        self._weights: tuple = ()  # what the graphs read of the model's weights

    def streamed(self) -> Any:
        """The context in which everything of these rows runs (their stream on a GPU)."""
        if self.stream is None:
            return _NoStream()
        return torch.cuda.stream(self.stream)

    # ---- capacity ----------------------------------------------------------------------------

    def reserve(self, slots: int, columns: int, sources: int, prefix: int) -> None:
        """Room for ``slots`` sentences, ``columns`` token columns, ``sources`` source
        positions and ``prefix`` forced tokens (capacities grow to powers of two; a change
        drops the captured graphs)."""
        want = Capacity(
            max(self.capacity.slots, bucket(slots)),
            max(self.capacity.columns, bucket(columns, LEAST_COLUMNS)),
            max(self.capacity.sources, bucket(sources, LEAST_COLUMNS)),
            max(self.capacity.prefix, bucket(prefix) if prefix else 0),  # 0: none yet
        )
        if want == self.capacity:
            return
        slots, columns, sources, prefix = want
        if self.decoder is None:
            self.decoder = _decoder_state(self.view)(
                self.view, slots, self.beam, columns, sources, self.dtype, self.device
            )
            self.search = SearchState.empty(slots, self.beam, columns, self.device, prefix)
        else:
            self.decoder = self.decoder.grown(slots, columns, sources)
            self.search = self.search.grown(slots, self.beam, columns, prefix)
        self.rules = Rules(self.options, columns, self.device)
        self.capacity = want
        self._graphs.clear()
        self._warm.clear()

    # ---- between steps -------------------------------------------------------------------

    def admit(
        self, slots: list[int], encoder_out: dict, first: int, max_lens: list[int],
        bos: list[int], prefixes: Tensor | None,
    ) -> None:  # fmt: skip
        """Sentences into ``slots``: rows ``first ..`` of ``encoder_out``, their maximum
        lengths, first tokens and forced prefixes (``[sentences, width]``, pad: free choice;
        or None); each starts with one live hypothesis (score 0) and beam - 1 dead ones."""
        beam, search, device = self.beam, self.search, self.device
        self._check_weights()
        slots_dev = to_device(slots, device)
        self.decoder.write_memory(slots_dev, encoder_out, first, len(slots))
        rows = _rows_of(slots_dev, beam)
        self.decoder.clear(rows)
        bos_rows = to_device(bos, device).unsqueeze(1).expand(-1, beam).reshape(-1)
        search.tokens[rows, 0] = bos_rows
        search.cumulative[rows, 0] = 0.0
        search.next_tokens[rows] = bos_rows
        search.reorder[rows] = rows
        start = torch.full((len(slots), beam), -math.inf, device=device)
        start[:, 0] = 0.0
        search.scores[slots_dev] = start
        search.steps[slots_dev] = 0
        search.max_lens[slots_dev] = to_device(max_lens, device)
        search.prefixes[slots_dev] = self.options.pad
        width = 0 if prefixes is None else prefixes.size(1)
        if width:
            search.prefixes[slots_dev, :width] = prefixes.to(device)
        search.prefix_lens[slots_dev] = width
        search.active[slots_dev] = True
        search.done[slots_dev] = False
        search.counts[slots_dev] = 0

    def _check_weights(self) -> None:
        """Drop the graphs if the model's weights are not those they read: changed, or made
        ready again (a fairseq transformer's prepared weights are made anew after fairseq's own
        forward ran)."""
        weights = getattr(getattr(self.view.decoder, "weights", None), "decoder_layers", None)
        key = (id(weights), *((p.data_ptr(), _version(p)) for p in self.view.parameters()))
        if key != self._weights:
            self._graphs.clear()
            self._warm.clear()
            self._weights = key

    def deactivate(self, slots: list[int]) -> None:
        """Stop searching in ``slots`` (cancelled sentences)."""
        slots_dev = to_device(slots, self.device)
        self.search.active[slots_dev] = False

    def move(self, old: list[int], new: list[int], columns: int) -> None:
        """Sentences from slots ``old`` to ``new`` (free ones), rows and all: the decoder's
        history in the beam order the last step chose; ``columns`` of it are in use."""
        device, beam, search = self.device, self.beam, self.search
        old_dev, new_dev = to_device(old, device), to_device(new, device)
        old_rows, new_rows = _rows_of(old_dev, beam), _rows_of(new_dev, beam)
        self.decoder.move(search.reorder.index_select(0, old_rows), new_rows, old_dev, new_dev,
                          columns)  # fmt: skip
        for name, tensor in search.tensors().items():
            kind = SearchState.KINDS[name]
            source, target = (old_dev, new_dev) if kind == SLOT else (old_rows, new_rows)
            if name == "reorder":
                tensor[new_rows] = new_rows  # the history moved in its new order already
            elif kind in (ROW, ENDED, SLOT):
                tensor.index_copy_(0, target, tensor.index_select(0, source))
        search.active[old_dev] = False
        search.done[old_dev] = False

    # ---- a step ----------------------------------------------------------------------------

    def step(self, size: Bucket) -> None:
        """One step of the first ``size.slots`` slots: a graph replayed, or run eagerly."""
        if not self.graphs_on or size in self._eager:
            self._step(size)
            return
        graph = self._graphs.get(size)
        if graph is None:
            if size not in self._warm:  # the first run warms up cuBLAS and the allocator
                self._warm.add(size)
                self._step(size)
                return
            graph = self._capture(size)
            if graph is None:
                self._step(size)
                return
        graph.replay()

    def _capture(self, size: Bucket) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                self._step(size)
        except RuntimeError as error:  # run it eagerly: slower, the same results
            logger.warning("a step of %s could not be captured as a CUDA graph: %s", size, error)
            self._eager.add(size)
            return None
        self._graphs[size] = graph
        return graph

    def _step(self, size: Bucket) -> None:
        """The step itself: static tensors in, static tensors out."""
        slots, columns, sources = size
        search, beam = self.search, self.beam
        rows = slots * beam
        positions = search.steps[:slots].unsqueeze(1).expand(slots, beam).reshape(-1)
        positions = positions.clamp(max=columns - 1)  # a done sentence's rows stop growing
        logits = self.decoder.step(
            search.next_tokens, positions, search.reorder, rows, columns, sources
        )
        lprobs = search_log_probs(self.view, logits.unsqueeze(1), None, self.options.temperature)
        fixed_rows_step.step(lprobs, search, self.rules, slots, columns)

    # ---- to the host -----------------------------------------------------------------------

    def done_flags(self) -> HostCopy:
        """Which slots' searches have ended, copied to the host without waiting."""
        return self._to_host([self.search.done])

    def ended(self, slots: list[int], columns: int) -> HostCopy:
        """The n-best rows of ``slots`` (their first ``columns + 1`` columns), copied to the
        host without waiting: an :class:`EndedRows` once ready."""
        search = self.search
        slots_dev = to_device(slots, self.device)
        rows = _rows_of(slots_dev, self.beam)
        width = columns + 1
        return self._to_host([
            search.counts.index_select(0, slots_dev),
            search.ended_tokens[:, :width].index_select(0, rows),
            search.ended_cumulative[:, :width].index_select(0, rows),
            search.ended_scores.index_select(0, rows),
            search.ended_lengths.index_select(0, rows),
        ])  # fmt: skip

    def _to_host(self, tensors: list[Tensor]) -> HostCopy:
        if self.stream is None:
            return HostCopy([t.clone() for t in tensors], None)
        copies = []
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copies.append(host.copy_(tensor, non_blocking=True))
        event = torch.cuda.Event()
        event.record(self.stream)
        return HostCopy(copies, event)


def _version(tensor: Tensor) -> int:
    """A tensor's version counter (inference tensors have none: they never change)."""
    try:
        return tensor._version
    except RuntimeError:
        return 0


def bucket(count: int, least: int = 1) -> int:
    """The power of two at or above ``count`` (and ``least``): the sizes steps are padded to."""
    return max(least, 1 << max(0, math.ceil(math.log2(max(count, 1)))))


def _rows_of(slots: Tensor, beam: int) -> Tensor:
    """The rows of sentence slots ``slots``, slot by slot."""
    return (slots.unsqueeze(1) * beam + torch.arange(beam, device=slots.device)).view(-1)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def fixed_rows_for(
    model: EnsembleDecoder, options: DecodingOptions, device: torch.device, graphs: bool
) -> FixedRows:
    """The fixed rows kept on ``model`` for these options and device (made on first use), so
    that engines made one after another (a generator makes one per batch) reuse the buffers
    and the captured graphs."""
    kept = model.__dict__.setdefault("_fixed_rows", {})
    key = (options, device, graphs)
    if key not in kept:
        kept[key] = FixedRows(model, options, device, graphs)
        logger.info("the device engine decodes on %s, %s", device,
                    "its steps as CUDA graphs" if kept[key].graphs_on else "one kernel at a time")

    return kept[key]

"""The models a search decodes with, as one: encoder outputs kept per sentence, decoder steps,
incremental states, log-probabilities averaged over the ensemble (and a language model's added,
for shallow fusion).

Sentences in flight are laid out sentence-major, beam decoder rows each, except sentences at
their first step: one row each (they come last) where every model reads the encoder output per
sentence. Two kinds of models:

* models that **mix steps** (beamplugin's convs2s; the interface: :class:`MixedStepEncoder`
  and :class:`MixedStepDecoder`): sentences at different steps share one forward. The decoder
  takes each row's position from its own left-padded token history, a new sentence's rows
  start from a zeroed state (``reorder_incremental_state(..., fresh_rows=k)``), and the encoder
  memory lives in a pool (``encoder.memory_pool()``) in which sentences keep their slot until
  they leave, so admitting or retiring a sentence copies only its own rows;
* all others (fairseq's fconv, transformer): one batch at a time, its encoder output reordered
  with the model's own ``reorder_encoder_out`` as sentences leave.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from fairseq.models import FairseqIncrementalDecoder
from torch import Tensor, nn

from beamplugin.kernels import log_probs
from beamplugin.models.mixed_step_transformer import mixed_step_view
from beamplugin.modules.output_columns import OutputColumns
from beamplugin.runtime.host_transfer import to_device


class EncoderMemory(Protocol):
    """A model's encoder output for the sentences in flight, slot ``i`` for sentence ``i``."""

    def write(self, first_slot: int, encoder_out: Any, rows: slice, width: int) -> None:
        """Put rows ``rows`` of ``encoder_out`` (sources of at most ``width`` positions: the
        last ones, sources are left-padded) at slots ``first_slot`` on."""

    def rearrange(self, order: list[int]) -> None:
        """Keep the sentences of slots ``order``, now at slots ``0 .. len(order) - 1``; none:
        let all of the memory go."""

    def view(self, groups: list[tuple[int, int]]) -> Any:
        """The encoder output the decoder reads this step: the slots from the first on, in
        groups of (sentences, decoder rows each); only models that mix steps are given groups
        that differ in rows."""


class MixedStepEncoder(Protocol):
    """The encoder of a model that mixes steps: its output goes into a pool of slots."""

    def memory_pool(self) -> EncoderMemory:
        """An empty pool for the encoder outputs of the sentences in flight."""


class MixedStepDecoder(Protocol):
    """The decoder of a model that mixes steps (``decodes_mixed_steps = True``): its forward
    takes rows at different steps (positions from each row's left-padded history, the encoder
    output as ``EncoderMemory.view`` gives it, ``need_attn``: whether to return attention), and
    its incremental state follows the rows."""

    decodes_mixed_steps: bool
    reads_encoder_out_per_sentence: bool  # one encoder row per sentence, whatever its rows

    def reorder_incremental_state(
        self, incremental_state: dict, new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows ``new_order``; the last ``fresh_rows`` of them start afresh."""


class ReorderedMemory:
    """Encoder output of one batch, shrunk with the model's ``reorder_encoder_out``.

    Decoders that read the encoder output per row (fconv, whose BeamableMM expects beam rows per
    sentence) get ``beam`` copies per sentence, as in fairseq; those that read it per sentence
    (convs2s in an ensemble with such a model) keep one row.
    """

    def __init__(self, encoder: nn.Module, rows_per_sentence: int) -> None:
        self.encoder = encoder
        self.rows_per_sentence = rows_per_sentence
        self.out: Any = None

    def write(self, first_slot: int, encoder_out: Any, rows: slice, width: int) -> None:
        if first_slot != 0:
            raise RuntimeError("this model decodes one batch at a time")
        if rows.start != 0:
            raise RuntimeError("these models take the encoder output of a whole batch")
        self.out = encoder_out  # the engine encodes exactly the batch it admits: all its rows
        if self.rows_per_sentence > 1:
            self.out = self._select(torch.arange(rows.stop, device=_device_of(encoder_out)), 1)

    def rearrange(self, order: list[int]) -> None:
        if not order:  # the batch is done: its encoder output goes
            self.out = None
            return
        self.out = self._select(to_device(order, _device_of(self.out)), self.rows_per_sentence)

    def _select(self, sentences: Tensor, rows_before: int) -> Any:
        rows = sentences * rows_before  # the first copy of each sentence: all are the same
        if self.rows_per_sentence > 1:
            rows = rows.repeat_interleave(self.rows_per_sentence)
        return self.encoder.reorder_encoder_out(self.out, rows)

    def view(self, groups: list[tuple[int, int]]) -> Any:
        return self.out


def _device_of(encoder_out: Any) -> torch.device:
    """The device of the first tensor found in a (nested) encoder output."""
    stack = [encoder_out]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            return item.device
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    raise ValueError("the encoder output holds no tensor")


class EnsembleDecoder(nn.Module):
    """Runs one or several encoder-decoder models as one; probabilities are averaged. With
    ``lm_model``, its log-probs times ``lm_weight`` are added (fairseq's shallow fusion)."""

    def __init__(
        self, models: list[nn.Module], lm_model: nn.Module | None = None, lm_weight: float = 1.0
    ) -> None:
        super().__init__()
        for model in models:
            if getattr(model, "encoder", None) is None or getattr(model, "decoder", None) is None:
                raise ValueError(
                    f"SequenceGenerator needs encoder-decoder models, got {type(model).__name__}"
                )
        models, self.why_not_mixed = _mixing_views(models)
        self.models = nn.ModuleList(models)
        self.lm_model, self.lm_weight = lm_model, lm_weight
        self.mixes_steps = self.why_not_mixed is None
        self.incremental = self.mixes_steps or all(
            isinstance(m.decoder, FairseqIncrementalDecoder) for m in models
        )
        # Decoders that read one encoder_out row per sentence whatever their rows per sentence
        # (beamplugin's convs2s); the others get a copy per decoder row, as in fairseq, and may
        # assume beam rows per sentence (fconv's BeamableMM does).
        self.per_sentence = [
            getattr(m.decoder, "reads_encoder_out_per_sentence", False) for m in models
        ]
        # A new hypothesis is one row until its first step when every model reads the encoder
        # output per sentence; the others decode beam identical rows, as in fairseq.
        self.first_step_one_row = all(self.per_sentence)

    def max_decoder_positions(self) -> int:
        return min(m.max_decoder_positions() for m in self.models)

    def max_source_positions(self) -> int:
        return min(m.encoder.max_positions() for m in self.models)

    def encode(self, net_input: dict[str, Tensor]) -> list[Any]:
        return [model.encoder.forward_torchscript(net_input) for model in self.models]

    def encoder_memories(self, beam: int) -> list[EncoderMemory]:
        if self.mixes_steps:
            return [model.encoder.memory_pool() for model in self.models]
        return [
            ReorderedMemory(model.encoder, 1 if per_sentence else beam)
            for model, per_sentence in zip(self.models, self.per_sentence, strict=True)
        ]

    def reorderers(self) -> list[list[nn.Module]]:
        """Per model, the decoder modules that keep incremental state: what fairseq's
        ``reorder_incremental_state_scripting`` finds by walking all modules at every step."""
        if not self.incremental:
            return [[] for _ in self.models]
        if self.mixes_steps:  # MixedStepDecoder.reorder_incremental_state moves all its state
            return [[model.decoder] for model in self.models]
        return [
            [m for m in model.decoder.modules() if hasattr(m, "reorder_incremental_state")]
            for model in self.models
        ]

    def reorder_states(
        self,
        reorderers: list[list[nn.Module]],
        states: list[dict],
        order: Tensor,
        fresh_rows: int = 0,
    ) -> None:
        """Keep the rows of ``order``; the last ``fresh_rows`` of them start afresh (only models
        that mix steps are given any)."""
        extra = {"fresh_rows": fresh_rows} if fresh_rows else {}
        for modules, state in zip(reorderers, states, strict=True):
            for module in modules:
                result = module.reorder_incremental_state(state, order, **extra)
                if result is not None:
                    state = result

    def decode_step(
        self,
        tokens: Tensor,
        encoder_outs: list[Any],
        states: list[dict],
        temperature: float,
        attention: bool = True,
        columns: OutputColumns | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[rows, vocab]`` (float32) of the next token and attention
        ``[rows, src]`` (None without ``attention``, or where the models give none). With
        ``columns``, each row's over the tokens it may take (-inf elsewhere): decoders that
        compute only those (``computes_output_columns``) are handed them, the others' logits
        are restricted after."""
        lprobs, attns = [], []
        for model, encoder_out, state in zip(self.models, encoder_outs, states, strict=True):
            # forward itself, as fairseq's generator calls it (no module hooks: a few us a step)
            decoder = model.decoder.forward
            computed = False  # whether the decoder took the columns itself
            if self.mixes_steps:
                kwargs = {"need_attn": attention}
                if columns is not None and getattr(model.decoder, "computes_output_columns", False):
                    kwargs["output_columns"], computed = columns, True
                out = decoder(tokens, encoder_out=encoder_out, incremental_state=state, **kwargs)
            elif self.incremental:
                out = decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            else:
                out = decoder(tokens, encoder_out=encoder_out)
            extra = out[1] if len(out) > 1 else None
            step_lprobs = search_log_probs(model, out[0], extra, temperature, columns, computed)
            if computed and len(self.models) > 1:  # the next model writes the same buffer
                step_lprobs = step_lprobs.clone()
            lprobs.append(step_lprobs)
            attn = _last_step_attention(extra) if attention else None
            if attn is not None:
                attns.append(attn.float())
        if len(lprobs) == 1:
            mean_lprobs, mean_attn = lprobs[0], attns[0] if attns else None
        else:
            # log of the mean probability, as fairseq's EnsembleModel
            mean_lprobs = torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))
            mean_attn = torch.stack(attns).sum(0).div_(len(attns)) if attns else None
        if self.lm_model is not None:
            lm_out = self.lm_model(tokens)
            lm_lprobs = self.lm_model.get_normalized_probs(lm_out, log_probs=True, sample=None)
            mean_lprobs = mean_lprobs + lm_lprobs[:, -1, :] * self.lm_weight
        return mean_lprobs, mean_attn


def _mixing_views(models: list[nn.Module]) -> tuple[list[nn.Module], str | None]:
    """``models`` as models that mix steps, where every one of them can (fairseq's
    transformer through beamplugin.models.mixed_step_transformer); else as they are, and why
    they cannot."""
    views, reasons = [], []
    for model in models:
        if getattr(model.decoder, "decodes_mixed_steps", False):
            views.append(model)
            continue
        view, reason = mixed_step_view(model)
        views.append(view)
        if view is None:
            reasons.append(reason or f"{type(model).__name__} decodes one batch at a time")
    if reasons:
        return models, "; ".join(dict.fromkeys(reasons))
    return views, None


def search_log_probs(
    model: nn.Module,
    logits: Tensor,
    extra: Any,
    temperature: float,
    columns: OutputColumns | None = None,
    computed: bool = False,
) -> Tensor:
    """The log-probs ``[rows, vocab]`` of the next token that the search reads: float32 whatever
    precision the model computes in, its last step's logits widened before the temperature and
    the model's log-softmax, so the search's scores, length normalisation and stop tests are
    float32 (see beamplugin.fairseq_plugin.precision). With ``columns``, -inf at every token a
    row may not take, each row normalised over its own: the logits of a decoder that
    ``computed`` the columns itself (ours, whose log-softmax is fairseq's plain one) are
    normalised over each row's columns alone (:meth:`OutputColumns.log_softmax`: a 256k
    vocabulary is not read again); the others' are restricted before the model's log-softmax.
    Our models' float32 logits (``plain_softmax``) are the step's own: normalised where they lie
    (a 256k vocabulary's log-probs of 64 sentences are 328 MB, not held twice nor mapped afresh
    each step), by our kernel where it is faster than torch's (beamplugin.kernels.log_probs)."""
    if logits.size(1) > 1:
        logits = logits[:, -1:, :]
    if computed:
        vocab = len(model.decoder.dictionary)  # the logits may be of the columns alone
        return columns.log_softmax(logits.squeeze(1), vocab, temperature)
    if (
        columns is None
        and logits.dtype == torch.float32
        and logits.is_contiguous()
        and getattr(model, "plain_softmax", False)
    ):
        if temperature != 1.0:
            logits.div_(temperature)
        if not log_probs.log_softmax_(logits):
            torch.log_softmax(logits, -1, out=logits)
        return logits.squeeze(1)
    logits = logits.float()
    if columns is not None:
        logits = columns.restrict(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lprobs = model.get_normalized_probs((logits, extra), log_probs=True, sample=None)
    return lprobs.squeeze(1).float()


def _last_step_attention(extra: Any) -> Tensor | None:
    attn = extra
    if isinstance(extra, dict):
        attn = extra.get("attn")
        if isinstance(attn, list | tuple):
            attn = attn[0] if attn else None
    if not isinstance(attn, Tensor):
        return None
    return attn[:, -1, :]

"""What our tasks add to a fairseq translation task: our generator, batching that loses no
sentence, fairseq-generate's batches decoded as one stream, over-long sentences named, and
fairseq-interactive's lines refused one by one. ``beam_translation`` puts it on fairseq's
``translation``, ``beam_translation_multi`` on ``translation_multi_simple_epoch``."""

# No `from __future__ import annotations` here: fairseq reads the config fields' types at runtime.
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from fairseq.data import FairseqDataset
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask

from beamplugin.fairseq_plugin.batching import LosslessBatchingDataset
from beamplugin.fairseq_plugin.constraints_file import with_constraints
from beamplugin.fairseq_plugin.generation_stream import Batch, ReadAhead
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.fairseq_plugin.interactive_input import (
    InteractiveLines,
    WithoutEmptySources,
    read_stdin_leniently,
)
from beamplugin.fairseq_plugin.line_input import LineEncoder, max_source_positions
from beamplugin.fairseq_plugin.precision import cast_for_decoding, requested_precision
from beamplugin.search.vocabulary_map import VocabularyMap

logger = logging.getLogger(__name__)

BATCHING_CHOICES = ChoiceEnum(["continuous", "static"])
STOPPING_CHOICES = ChoiceEnum(["fairseq", "exact"])
LENPEN_CHOICES = ChoiceEnum(["fairseq", "gnmt"])
DEVICE_ENGINE_CHOICES = ChoiceEnum(["auto", "on", "off"])


@dataclass
class BeamSearchConfig(FairseqDataclass):
    """Our options, on top of the translation task's."""

    batching: BATCHING_CHOICES = field(
        default="continuous",
        metadata={
            "help": "how fairseq-generate (and --eval-bleu validation) decode: 'continuous' as "
            "one stream, new sentences joining as others finish, with --batch-size sentences "
            "or --max-tokens source tokens in flight; 'static' batch after batch"
        },
    )
    search_stop: STOPPING_CHOICES = field(
        default="fairseq",
        metadata={
            "help": "when a sentence stops: 'fairseq' once it holds --beam finished hypotheses "
            "(fairseq's rule, identical outputs); 'exact' only when no alive hypothesis can "
            "still beat the worst finished one under the length penalty"
        },
    )
    lenpen_style: LENPEN_CHOICES = field(
        default="fairseq",
        metadata={
            "help": "length normalisation: 'fairseq' divides by len**lenpen, 'gnmt' by "
            "((5 + len) / 6)**lenpen (Wu et al. 2016)"
        },
    )
    vocabulary_map: Optional[str] = field(  # noqa: UP045 (fairseq reads typing.Optional only)
        default=None,
        metadata={
            "help": "a vocabulary map (CTranslate2's format: '<source n-gram>\\t<target "
            "tokens>' a line): each sentence may take only the target tokens its source's "
            "n-grams list (and those of lines with no n-gram), probabilities normalised over "
            "them; the output projection multiplies those columns alone. Changes results: "
            "docs/fairseq.md"
        },
    )
    device_engine: DEVICE_ENGINE_CHOICES = field(
        default="auto",
        metadata={
            "help": "the whole beam step on the device, each sentence in fixed rows, steps as "
            "CUDA graphs: 'auto' on a GPU (for a transformer or convs2s, without "
            "--print-alignment, --match-source-len, --search-stop "
            "exact or a vocabulary map), 'on' also on the CPU, 'off' never"
        },
    )
    no_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "the device engine's steps run one kernel at a time (to compare)"},
    )
    constraints_file: Optional[str] = field(  # noqa: UP045 (fairseq reads typing.Optional only)
        default=None,
        metadata={
            "help": "fairseq-generate --constraints: the constraints of --gen-subset's "
            "sentences, line i those of sentence i, tab-separated, in the target's "
            "preprocessed form (blank: none)"
        },
    )
    int8: bool = field(
        default=False,
        metadata={
            "help": "CPU only: multiply the largest weights (vocabulary projection, "
            "convolutions) in int8, scales per output channel and activations quantized per "
            "row, so a sentence's result does not depend on its batch-mates; everything else "
            "and the search in float32"
        },
    )


def _as_tuple(size: Any) -> tuple:
    return tuple(size) if isinstance(size, tuple | list) else (size,)


# Strategies that only fairseq's own generator implements; we hand those to it unchanged.
def _needs_fairseq_generator(args: Any, prefix_allowed_tokens_fn: Any) -> str | None:
    checks = {
        "--sampling": getattr(args, "sampling", False),
        "--diverse-beam-groups": getattr(args, "diverse_beam_groups", -1) > 0,
        "--diversity-rate": getattr(args, "diversity_rate", -1) > -1,
        "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn is not None
        or getattr(args, "prefix_allowed_tokens_fn", None) is not None,
    }
    return next((name for name, used in checks.items() if used), None)


class BeamSearchTask:
    """Put before a fairseq translation task in a task's bases; its ``__init__`` calls
    :meth:`setup_beam_search` after the fairseq task's. ``beam_options`` is where
    :class:`BeamSearchConfig`'s fields and ``fp16``/``bf16`` are read (a dataclass task's
    ``cfg``, a legacy task's ``args``)."""

    beam_options: Any

    def setup_beam_search(self) -> None:
        # One wrapper per dataset, so fairseq's per-dataset iterator cache keeps working.
        self._lossless: dict[int, LosslessBatchingDataset] = {}
        self._interactive_lines = InteractiveLines()
        self._max_source_positions = self.max_line_tokens([])
        self._read_ahead: ReadAhead | None = None  # the batches handed out last
        self._prefix_size = 0
        self._split_without_constraints: str | None = None  # fairseq-generate's, if so

    def decoder_prompts(self, batch: Batch) -> tuple[torch.Tensor | None, int | None]:
        """How the hypotheses of ``batch``'s sentences start: their forced prefixes
        ``[sentences, p]`` (``--prefix-size`` tokens of the reference; None: none), after a BOS
        (None: EOS, fairseq's)."""
        if self._prefix_size > 0:
            return batch["target"][:, : self._prefix_size], None
        return None, None

    def load_dataset(self, split: str, *args: Any, **kwargs: Any) -> None:
        """fairseq's split, its sentences carrying their ``--constraints-file`` constraints if
        one is given."""
        super().load_dataset(split, *args, **kwargs)
        path = getattr(self.beam_options, "constraints_file", None)
        if path:
            self.datasets[split] = with_constraints(
                self.datasets[split], path, self.target_dictionary
            )
        else:
            self._split_without_constraints = split

    def get_batch_iterator(self, dataset: FairseqDataset, **kwargs: Any) -> Any:
        wrapped = self._lossless.get(id(dataset))
        if wrapped is None or wrapped.dataset is not dataset:
            wrapped = self._lossless[id(dataset)] = LosslessBatchingDataset(dataset)
        epochs = super().get_batch_iterator(wrapped, **kwargs)
        if self.beam_options.batching == "continuous" and not hasattr(
            epochs, "_beamplugin_reads_ahead"
        ):
            # Each epoch's batches can be read ahead by inference_step (see generation_stream).
            next_epoch_itr = epochs.next_epoch_itr
            capacity = kwargs.get("max_sentences"), kwargs.get("max_tokens")

            def read_ahead(*args: Any, **kw: Any) -> ReadAhead:
                self._read_ahead = ReadAhead(next_epoch_itr(*args, **kw), *capacity)
                return self._read_ahead

            epochs.next_epoch_itr = read_ahead
            epochs._beamplugin_reads_ahead = True
        return epochs

    def inference_step(
        self,
        generator: Any,
        models: list[Any],
        sample: dict[str, Any],
        prefix_tokens: Any = None,
        constraints: Any = None,
    ) -> Any:
        """With continuous batching, the hypotheses of a batch that fairseq-generate or
        fairseq-interactive handed out, decoded in one stream with the batches before and after
        it (in fairseq-interactive: those of the same buffer); ``constraints`` are the batch's
        own (its sample's), which the stream reads from it."""
        batches = self._read_ahead
        if (
            isinstance(generator, SequenceGenerator)
            and batches is not None
            and batches.is_current(sample)
        ):
            # fairseq-interactive's lines (read in buffers) are refused one by one, by id
            lines = self._interactive_lines
            refuse = lines.refuse_decoded if lines.lines_read else None
            return batches.start_stream(generator, self.decoder_prompts).hypotheses(refuse)
        return super().inference_step(generator, models, sample, prefix_tokens, constraints)

    def filter_indices_by_size(
        self,
        indices: Any,
        dataset: FairseqDataset,
        max_positions: Any = None,
        ignore_invalid_inputs: bool = False,
    ) -> Any:
        """Refuse over-long sentences by name, or leave them out and list every one."""
        kept, too_long = dataset.filter_indices_by_size(indices, max_positions)
        if len(too_long) == 0:
            return kept
        described = ", ".join(
            f"#{int(i)} ({'/'.join(map(str, map(int, _as_tuple(dataset.size(i)))))} tokens)"
            for i in too_long[:5]
        )
        if not ignore_invalid_inputs:
            raise ValueError(
                f"{len(too_long)} sentence(s) are longer than the model accepts "
                f"(max positions {max_positions}): {described}. Shorten or split them, or pass "
                "--skip-invalid-size-inputs-valid-test to leave them out."
            )
        logger.warning(
            "leaving out %d over-long sentence(s) (max positions %s), ids: %s",
            len(too_long),
            max_positions,
            " ".join(str(int(i)) for i in too_long),
        )
        return kept

    def build_generator(
        self,
        models: list[Any],
        args: Any,
        seq_gen_cls: type | None = None,
        extra_gen_cls_kwargs: dict[str, Any] | None = None,
        prefix_allowed_tokens_fn: Any = None,
    ) -> Any:
        self._prepare_for_input_lines(models)
        self._prefix_size = getattr(args, "prefix_size", 0) or 0
        if getattr(args, "constraints", None) and self._split_without_constraints:
            logger.warning(
                "--constraints: the binarized split '%s' carries no constraints, so none are "
                "met; --constraints-file gives them (docs/glossaries.md)",
                self._split_without_constraints,
            )
        options = self.beam_options
        precision = requested_precision(options.fp16, options.bf16, options.int8)
        if precision != "float32":
            lm_model = (extra_gen_cls_kwargs or {}).get("lm_model")
            dtype = cast_for_decoding([*models, lm_model], precision)
            logger.info("decoding in %s (models in %s), the search in float32", precision, dtype)
        other = _needs_fairseq_generator(args, prefix_allowed_tokens_fn)
        shortlist = self._vocabulary_map()
        if seq_gen_cls is not None or getattr(args, "score_reference", False) or other:
            if shortlist is not None:
                raise ValueError(f"--vocabulary-map needs beamplugin's generator, and "
                                 f"{other or 'this run'} is served by fairseq's")  # fmt: skip
            if other:
                logger.info("%s is served by fairseq's own SequenceGenerator", other)
            # FairseqTask's, by name: translation_multi_simple_epoch's own ignores seq_gen_cls
            # (the rest of what it does, beam_translation_multi does before calling this).
            return FairseqTask.build_generator(
                self, models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        kwargs = dict(extra_gen_cls_kwargs or {})
        kwargs.update(
            stopping=str(options.search_stop),
            length_penalty_style=str(options.lenpen_style),
            print_alignment=getattr(args, "print_alignment", None),
            nbest=getattr(args, "nbest", None),
            # fairseq-generate and -interactive read a hypothesis' attention only to print
            # its alignment
            attention=bool(getattr(args, "print_alignment", None)),
            shortlist=shortlist,
            device_engine=str(options.device_engine),
            cuda_graphs=not options.no_cuda_graphs,
        )
        return FairseqTask.build_generator(
            self, models, args, seq_gen_cls=SequenceGenerator, extra_gen_cls_kwargs=kwargs
        )

    def _vocabulary_map(self) -> VocabularyMap | None:
        """The task's ``--vocabulary-map``, read with its dictionaries (None: none given)."""
        path = getattr(self.beam_options, "vocabulary_map", None)
        if not path:
            return None
        target = self.target_dictionary
        special = [target.bos(), target.pad(), target.eos(), target.unk()]
        return VocabularyMap.read(path, self.source_dictionary.indices, target.indices, special)

    def max_line_tokens(self, models: list[Any]) -> int | None:
        """The most tokens (end of sentence included) of an input line's source."""
        return max_source_positions(self, models)

    def _prepare_for_input_lines(self, models: list[Any]) -> None:
        # fairseq-interactive builds the generator right before it reads its input.
        self._max_source_positions = self.max_line_tokens(models)
        read_stdin_leniently()

    def get_interactive_tokens_and_lengths(
        self, lines: list[str], encode_fn: Callable[[str], str]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """fairseq-interactive's next buffer of lines: every line is encoded by LineEncoder or
        refused with an ``E-<id>`` line (beamplugin.fairseq_plugin.interactive_input), never
        lost."""
        encoder = LineEncoder(self.source_dictionary, self._max_source_positions, encode_fn)
        return self._interactive_lines.encode_buffer(lines, encoder)

    def build_dataset_for_inference(
        self, src_tokens: list[torch.Tensor], src_lengths: list[int], constraints: Any = None
    ) -> FairseqDataset:
        dataset = super().build_dataset_for_inference(src_tokens, src_lengths, constraints)
        return WithoutEmptySources(dataset)

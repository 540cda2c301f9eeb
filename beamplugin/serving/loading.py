"""Loading what decodes: the models of fairseq-interactive's options, prepared as
fairseq-interactive prepares them, their generator (task beam_translation or
beam_translation_multi), and the settings the text side needs to know of them."""

from __future__ import annotations

import ast
import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from fairseq import checkpoint_utils, tasks, utils
from fairseq_cli.generate import get_symbols_to_strip_from_output
from omegaconf import DictConfig

from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.fairseq_plugin.line_input import max_source_positions
from beamplugin.streams import TranslationStream

logger = logging.getLogger(__name__)

# Sentences in flight when neither --batch-size nor --max-tokens is given (fairseq-interactive's
# default of 1 would make a server that decodes one sentence at a time).
DEFAULT_CAPACITY = 64


@dataclass(frozen=True)
class DecoderSettings:
    """What the side that reads and writes text needs to know of the decoding side."""

    beam: int
    max_source_positions: int | None
    symbols_to_strip: frozenset[int]
    max_sentences: int | None  # capacity: sentences in flight
    max_tokens: int | None  # capacity: source tokens in flight (beam x that in the engine)

    def stream(self, generator: SequenceGenerator, max_queued: int) -> TranslationStream:
        """A stream decoding with ``generator`` at this capacity."""
        max_tokens = self.max_tokens and self.max_tokens * self.beam
        return TranslationStream(generator, self.max_sentences, max_tokens, max_queued)


def load_decoder(cfg: DictConfig, task: Any = None) -> tuple[SequenceGenerator, DecoderSettings]:
    """The models of ``cfg`` loaded and prepared as fairseq-interactive prepares them, their
    generator, and what the text side needs to know of them."""
    task = task or tasks.setup_task(cfg.task)
    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    logger.info("loading model(s) from %s", cfg.common_eval.path)
    models, _ = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path),
        arg_overrides=overrides,
        task=task,
        suffix=cfg.checkpoint.checkpoint_suffix,
        strict=(cfg.checkpoint.checkpoint_shard_count == 1),
        num_shards=cfg.checkpoint.checkpoint_shard_count,
    )
    device = decoding_device(cfg)
    for model in models:  # --fp16/--bf16/--int8: the task's build_generator casts them
        model.to(device)
        model.prepare_for_inference_(cfg)
    # Every hypothesis of the beam comes back, so a request can ask for up to --beam of them.
    generation = copy.deepcopy(cfg.generation)
    generation.nbest = generation.beam
    generator = task.build_generator(models, generation)
    if not isinstance(generator, SequenceGenerator):
        raise ValueError(
            "the server decodes with beamplugin's beam search (task beam_translation, or "
            "beam_translation_multi); "
            "--sampling and diverse beam search are not served"
        )
    max_tokens = cfg.dataset.max_tokens
    settings = DecoderSettings(
        beam=generator.beam_size,
        max_source_positions=max_source_positions(task, models),
        symbols_to_strip=frozenset(get_symbols_to_strip_from_output(generator)),
        max_sentences=cfg.dataset.batch_size or (None if max_tokens else DEFAULT_CAPACITY),
        max_tokens=max_tokens,
    )
    return generator, settings


def decoding_device(cfg: DictConfig) -> torch.device:
    """Where the models decode: CUDA unless --cpu or none is there."""
    return torch.device("cuda" if torch.cuda.is_available() and not cfg.common.cpu else "cpu")

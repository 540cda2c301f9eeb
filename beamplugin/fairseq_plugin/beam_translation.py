"""The ``beam_translation`` task: fairseq's translation task with our generator and batching."""

# No `from __future__ import annotations` here: fairseq reads the config fields' types at runtime.
from dataclasses import dataclass
from typing import Any

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from beamplugin.fairseq_plugin.beam_task import BeamSearchConfig, BeamSearchTask


@dataclass
class BeamTranslationConfig(TranslationConfig, BeamSearchConfig):
    # fairseq's --fp16 / --bf16 (fairseq-generate casts the models only for --fp16)
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")


@register_task("beam_translation", dataclass=BeamTranslationConfig)
class BeamTranslationTask(BeamSearchTask, TranslationTask):
    """Translation with beamplugin's SequenceGenerator and batching that loses no sentence."""

    cfg: BeamTranslationConfig

    def __init__(self, cfg: BeamTranslationConfig, src_dict: Any, tgt_dict: Any) -> None:
        super().__init__(cfg, src_dict, tgt_dict)
        self.setup_beam_search()

    @property
    def beam_options(self) -> BeamTranslationConfig:
        return self.cfg

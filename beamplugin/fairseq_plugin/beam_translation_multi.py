"""The ``beam_translation_multi`` task: fairseq's ``translation_multi_simple_epoch`` (the task
of M2M-100 and NLLB) with our generator and batching.

fairseq-generate and fairseq-interactive decode one pair a run (``-s``/``-t``), the source's
language token put there by fairseq's datasets, the target's by :meth:`decoder_prompts` as
fairseq's ``inference_step`` puts it (a forced first token, or the BOS with
``--lang-tok-replacing-bos-eos``), and stripped from the output as fairseq's ``build_generator``
says (unless ``--keep-inference-langtok``). Any other pair of ``--lang-pairs``:
:attr:`languages` (beamplugin.fairseq_plugin.language_pairs), sentence by sentence, as the
server asks for them.
"""

from functools import cached_property
from typing import Any

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask
from torch import Tensor

from beamplugin.fairseq_plugin.beam_task import BeamSearchConfig, BeamSearchTask
from beamplugin.fairseq_plugin.generation_stream import Batch
from beamplugin.fairseq_plugin.language_pairs import LanguagePairs, LanguageTokens


@register_task("beam_translation_multi")
class BeamTranslationMultiTask(BeamSearchTask, TranslationMultiSimpleEpochTask):
    """Multilingual translation with beamplugin's SequenceGenerator and batching."""

    @staticmethod
    def add_args(parser: Any) -> None:
        TranslationMultiSimpleEpochTask.add_args(parser)
        gen_parser_from_dataclass(parser, BeamSearchConfig())

    def __init__(self, args: Any, langs: list[str], dicts: dict, training: bool) -> None:
        super().__init__(args, langs, dicts, training)
        self.setup_beam_search()

    @property
    def beam_options(self) -> Any:
        return self.args

    @cached_property
    def languages(self) -> LanguagePairs:
        """Every pair of ``--lang-pairs``, the default one that of ``-s`` and ``-t`` (needed:
        decoding only)."""
        return LanguagePairs.of(self)

    def decoder_prompts(self, batch: Batch) -> tuple[Tensor | None, int | None]:
        prefixes, _ = super().decoder_prompts(batch)
        prompt = self.languages.prompt(self.languages.default)
        if prompt.bos is not None:
            return prefixes, prompt.bos
        if prefixes is None and prompt.prefix is not None:
            prefixes = prompt.prefix.expand(batch["net_input"]["src_tokens"].size(0), 1)
        return prefixes, None

    def max_line_tokens(self, models: list[Any]) -> int | None:
        limit = super().max_line_tokens(models)
        if limit is None:
            return None
        tokens = LanguageTokens.of(self.args, self.source_dictionary, self.target_dictionary)
        return limit - tokens.added_source_tokens  # room for the source's language token

    def build_generator(
        self,
        models: list[Any],
        args: Any,
        seq_gen_cls: type | None = None,
        extra_gen_cls_kwargs: dict[str, Any] | None = None,
        prefix_allowed_tokens_fn: Any = None,
    ) -> Any:
        kwargs = dict(extra_gen_cls_kwargs or {})
        strip = self.languages.output_tokens(self.languages.default)
        if strip:
            kwargs["symbols_to_strip_from_output"] = set(strip)
        return super().build_generator(
            models, args, seq_gen_cls, kwargs, prefix_allowed_tokens_fn
        )

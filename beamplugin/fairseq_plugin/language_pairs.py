"""The language pairs a task's models translate, and how a sentence says which pair it is in.

A bilingual task translates one pair and says nothing. A multilingual one (fairseq's
``translation_multi_simple_epoch``, and ``beam_translation_multi`` on it) says it with language
tokens, as fairseq's data manager puts them (``--encoder-langtok src|tgt``,
``--decoder-langtok``, ``--lang-tok-style``): on the source side the token of the source (or
target) language is prepended, or with ``--lang-tok-replacing-bos-eos`` takes the place of the
source's EOS; on the target side the target language's token is the hypotheses' forced first
token, or with ``--lang-tok-replacing-bos-eos`` their BOS. fairseq looks the tokens up for the one
pair of its run (``-s``/``-t``); here any pair of ``--lang-pairs`` can be asked for, sentence by
sentence, the tokens coming from the same (shared) dictionary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from fairseq.data import Dictionary
from fairseq.data.multilingual.multilingual_utils import get_lang_tok
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask
from torch import Tensor

from beamplugin.streams import Prompt

Pair = tuple[str, str]


@dataclass(frozen=True)
class LanguageTokens:
    """The language tokens of a multilingual task's options ``args``."""

    source_dictionary: Dictionary
    target_dictionary: Dictionary
    style: str  # --lang-tok-style
    encoder: str | None  # --encoder-langtok: "src", "tgt" or None
    decoder: str | None  # "tgt" with --decoder-langtok, else None
    replaces_bos_eos: bool  # --lang-tok-replacing-bos-eos
    kept_in_output: bool  # --keep-inference-langtok

    @classmethod
    def of(cls, args: Any, source: Dictionary, target: Dictionary) -> LanguageTokens:
        encoder, decoder = args.langtoks["main"]
        replaces = bool(args.lang_tok_replacing_bos_eos)
        kept = bool(getattr(args, "keep_inference_langtok", False))
        return cls(source, target, args.lang_tok_style, encoder, decoder, replaces, kept)

    @property
    def added_source_tokens(self) -> int:
        """Tokens a source gets on top of its own (and its EOS)."""
        return int(self.encoder is not None and not self.replaces_bos_eos)

    def source(self, pair: Pair) -> int | None:
        """The source side's language token (fairseq's ``get_encoder_langtok``)."""
        if self.encoder is None:
            return None
        lang = pair[0] if self.encoder.startswith("src") else pair[1]
        return self._index(lang, self.encoder, self.source_dictionary)

    def target(self, target: str) -> int | None:
        """The target side's language token (fairseq's ``get_decoder_langtok``)."""
        if self.decoder is None:
            return None
        return self._index(target, self.decoder, self.target_dictionary)

    def _index(self, lang: str, spec: str, dictionary: Dictionary) -> int:
        token = get_lang_tok(lang=lang, lang_tok_style=self.style, spec=spec)
        index = dictionary.index(token)
        if index == dictionary.unk():
            raise ValueError(f"the dictionary has no language token {token} for {lang!r}")
        return index


class LanguagePairs:
    """The pairs ``pairs`` (in the order given), ``default`` the one of the options' ``-s`` and
    ``-t``; ``tokens`` None for a bilingual task."""

    def __init__(self, pairs: Iterable[Pair], default: Pair,
                 tokens: LanguageTokens | None = None) -> None:  # fmt: skip
        self.pairs = list(dict.fromkeys([*pairs, default]))
        self.default = default
        self.tokens = tokens
        self._targets: dict[str, list[str]] = {}  # M2M-100 has 9,900 pairs: looked up, not searched
        for source, target in self.pairs:
            self._targets.setdefault(source, []).append(target)
        for pair in self.pairs if tokens else ():  # a missing token stops the start, not a request
            tokens.source(pair)
            tokens.target(pair[1])

    @classmethod
    def of(cls, task: Any) -> LanguagePairs:
        """What ``task`` (set up for inference: ``-s`` and ``-t`` given) translates."""
        if not isinstance(task, TranslationMultiSimpleEpochTask):
            cfg = task.cfg
            return cls([], (cfg.source_lang, cfg.target_lang))
        args = task.args
        if args.source_lang is None or args.target_lang is None:
            raise ValueError("-s/--source-lang and -t/--target-lang are needed: the default pair")
        pairs = [tuple(pair.split("-")) for pair in args.lang_pairs]
        tokens = LanguageTokens.of(args, task.source_dictionary, task.target_dictionary)
        return cls(pairs, (args.source_lang, args.target_lang), tokens)

    @property
    def multilingual(self) -> bool:
        return len(self.pairs) > 1

    @property
    def added_source_tokens(self) -> int:
        """Tokens a source gets on top of its own (and its EOS)."""
        return 0 if self.tokens is None else self.tokens.added_source_tokens

    def knows(self, pair: Pair) -> bool:
        return pair[1] in self._targets.get(pair[0], ())

    def sources(self) -> list[str]:
        """The source languages, in the order of the pairs."""
        return list(self._targets)

    def targets(self, source: str) -> list[str]:
        return list(self._targets.get(source, ()))

    def source_tokens(self, pair: Pair, tokens: Tensor) -> Tensor:
        """``tokens`` (1-D, ending in EOS) as the encoder reads them in ``pair``."""
        token = None if self.tokens is None else self.tokens.source(pair)
        if token is None:
            return tokens
        if self.tokens.replaces_bos_eos:
            return torch.cat([tokens[:-1], tokens.new_tensor([token])])
        return torch.cat([tokens.new_tensor([token]), tokens])

    def prompt(self, pair: Pair) -> Prompt:
        """How hypotheses in ``pair`` start (fairseq's ``inference_step``)."""
        token = None if self.tokens is None else self.tokens.target(pair[1])
        if token is None:
            return Prompt()
        if self.tokens.replaces_bos_eos:
            return Prompt(bos=token)
        return Prompt(prefix=torch.tensor([token]))

    def output_tokens(self, pair: Pair) -> frozenset[int]:
        """Tokens of ``pair`` that fairseq strips from the output, on top of EOS."""
        token = None if self.tokens is None else self.tokens.target(pair[1])
        if token is None or self.tokens.kept_in_output:
            return frozenset()
        return frozenset([token])

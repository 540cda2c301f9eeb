"""Text as a model reads and writes it: fairseq-interactive's tokenizer and BPE, set up from its
options as it sets them up, chained as its ``encode_fn`` and ``decode_fn``. Needs the task (its
dictionaries), not the models: a corpus's driver cuts glossary terms with it before any worker
loads them, the same cut the translator's sentences get."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fairseq.tasks import FairseqTask
from omegaconf import DictConfig


class TextPieces:
    """``cfg``'s tokenizer and BPE (fairseq-interactive's options) for ``task``."""

    def __init__(self, task: FairseqTask, cfg: DictConfig) -> None:
        tokenizer = task.build_tokenizer(cfg.tokenizer)
        bpe = task.build_bpe(cfg.bpe)
        self.encode = _chain([tokenizer, bpe], "encode")
        self.decode = _chain([bpe, tokenizer], "decode")

    def pieces(self, text: str) -> list[str]:
        """``text`` cut as the model reads it (the tokenizer, then the BPE); none for text that
        is not valid UTF-8 (lone surrogates, which the BPE would fail on: the line encoder
        refuses them, saying where)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return []
        return self.encode(text.strip()).split()


def _chain(steps: list[Any], method: str) -> Callable[[str], str]:
    """``text`` through ``method`` ("encode" or "decode") of each step that is there, in order
    (fairseq-interactive's encode_fn and decode_fn)."""
    calls = [getattr(step, method) for step in steps if step is not None]

    def apply(text: str) -> str:
        for call in calls:
            text = call(text)
        return text

    return apply

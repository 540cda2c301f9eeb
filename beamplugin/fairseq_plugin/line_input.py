"""One line of raw text to source tokens, or a refusal that says why.

The one place where a line of text becomes a model input: fairseq-interactive through the
``beam_translation`` task (so ``data/translate.sh``), and a translation server, line by line.
A line is refused, never half-translated, when it is not valid UTF-8 (stdin read with
``surrogateescape`` hands undecodable bytes over as lone surrogates, which sentencepiece cannot
take), when it is empty or nothing of it survives tokenization, or when it has more tokens
than the model's positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from fairseq import utils
from fairseq.data import Dictionary


class RefusedLine(ValueError):
    """A line that cannot be translated; ``reason`` says why, for a person to act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def max_source_positions(task: Any, models: Sequence[Any]) -> int | None:
    """The most source tokens (end of sentence included) that ``task`` and every model accept,
    as fairseq-interactive and fairseq-generate resolve it; None when nothing limits it."""
    limit = utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models])
    return limit[0] if isinstance(limit, tuple | list) else limit


def _not_utf8(text: str) -> str | None:
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as err:
        bad = text[err.start : err.end]
        # surrogateescape turns an undecodable byte 0xXY into U+DCXY: name the byte.
        shown = " ".join(
            f"0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"U+{ord(c):04X}"
            for c in bad
        )
        return f"not valid UTF-8: {shown} at character {err.start + 1}"


class LineEncoder:
    """Encodes lines for one model.

    ``dictionary`` is the model's source dictionary, ``max_positions`` the most source tokens it
    accepts, end of sentence included (``max_source_positions``; None: no limit), ``encode_fn``
    the text-to-pieces function (tokenizer, then BPE, as fairseq-interactive builds it; None:
    the text is already space-separated pieces).
    """

    def __init__(
        self,
        dictionary: Dictionary,
        max_positions: int | None,
        encode_fn: Callable[[str], str] | None = None,
    ) -> None:
        self.dictionary = dictionary
        self.max_positions = max_positions
        self.encode_fn = encode_fn

    def encode(self, line: str) -> torch.Tensor:
        """``line`` (surrounding blanks ignored, as fairseq-interactive strips them) as a 1-D
        LongTensor of source token ids ending with the dictionary's EOS.

        Raises RefusedLine when the line is not valid UTF-8, is empty, has nothing left after
        tokenization (control or zero-width characters only), or is longer than the model
        accepts. Words missing from the dictionary become ``<unk>``, as in fairseq.
        """
        text = line.strip()
        problem = _not_utf8(text)
        if problem:
            raise RefusedLine(problem)
        if not text:
            raise RefusedLine("empty line")
        pieces = self.encode_fn(text) if self.encode_fn is not None else text
        tokens = self.dictionary.encode_line(pieces, add_if_not_exist=False).long()
        if len(tokens) == 1:
            raise RefusedLine("nothing left to translate after tokenization")
        if self.max_positions is not None and len(tokens) > self.max_positions:
            raise RefusedLine(
                f"too long: {len(tokens)} tokens (end of sentence included), the model accepts "
                f"at most {self.max_positions}; split the line"
            )
        return tokens

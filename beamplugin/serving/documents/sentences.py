"""Where sentences are in a text: sentencex's rules for the source language (shipped in its
package, about 300 languages through fallbacks; docs/dependencies.md says why this segmenter),
then each piece too long for the model cut again at the whitespace nearest its middle, so that
no text is refused or lost for want of punctuation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sentencex


@dataclass(frozen=True)
class Segment:
    """``text[start:end]``, one sentence and the whitespace around it: ``text[core_start:
    core_end]`` is the sentence itself, ``translate`` False where it holds no letter (numbers,
    bullets, punctuation: copied rather than sent to the model)."""

    start: int
    core_start: int
    core_end: int
    end: int
    translate: bool


def segments(
    text: str, language: str, fits: Callable[[str], bool], lines_end_sentences: bool
) -> list[Segment]:
    """``text`` cut into segments that cover it end to end, in order: sentences by
    ``language``'s rules (its code before any ``_``: M2M-100's ``de``, mBART's ``de_DE``), also
    at every line break when ``lines_end_sentences`` (plain text: lists, headings and verse keep
    their lines), and a sentence that does not ``fit`` the model cut at whitespace until it
    does."""
    language = language.partition("_")[0]
    spans: list[tuple[int, int]] = []
    for start, end in _lines(text) if lines_end_sentences else [(0, len(text))]:
        line = text[start:end]
        cuts = [b["end_index"] for b in sentencex.get_sentence_boundaries(language, line)]
        for low, high in zip([0, *cuts], [*cuts, len(line)], strict=True):
            if low < high:
                spans.extend(_fitting(text, start + low, start + high, fits))
    return [_segment(text, start, end) for start, end in spans]


def _lines(text: str) -> list[tuple[int, int]]:
    """Each line of ``text`` with its line break."""
    spans, start = [], 0
    for line in text.splitlines(keepends=True):
        spans.append((start, start + len(line)))
        start += len(line)
    return spans


def _fitting(
    text: str, start: int, end: int, fits: Callable[[str], bool]
) -> list[tuple[int, int]]:
    """``text[start:end]`` as it is if it fits, else cut at the whitespace nearest its middle
    (at the middle where it has none: a script without spaces), each half cut again."""
    core = text[start:end].strip()
    if len(core) <= 1 or fits(core):
        return [(start, end)]
    middle = (start + end) // 2
    blanks = [i for i in range(start + 1, end) if text[i].isspace() and not text[i - 1].isspace()]
    cut = min(blanks, key=lambda i: abs(i - middle)) if blanks else middle
    return _fitting(text, start, cut, fits) + _fitting(text, cut, end, fits)


def _segment(text: str, start: int, end: int) -> Segment:
    piece = text[start:end]
    core_start = start + len(piece) - len(piece.lstrip())
    core_end = max(core_start, start + len(piece.rstrip()))
    translate = any(c.isalpha() for c in text[core_start:core_end])
    return Segment(start, core_start, core_end, end, translate)

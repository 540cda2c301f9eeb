"""A document as what the model translates and how its translation is put back together.

A document is parts copied as they are (markup, code, whatever is not to be translated) and
runs of text. A run is cut into sentences (:mod:`.sentences`); each sentence is one unit for
the engine, and the whitespace around it, line and paragraph breaks included, is copied from
the input. A run may hold marks (inline tags, comments) at positions of its text: a mark
between sentences, or in the whitespace around one, stays where it was; a mark inside a
sentence is put into its translation at the same place counted in words (marks keep their
order, so tags keep their nesting, and a tag wraps the words at the place of the words it
wrapped: those words themselves where the model keeps word order; a mark inside a word moves
to a word's edge).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from beamplugin.serving.documents.sentences import Segment, segments

# A mark between two of a file's pieces of text (a .docx's runs, an .odt's spans): a private-use
# character, in no text a model translates
BOUNDARY = "\ue000"
WORD = re.compile(r"\w+")  # punctuation is not a word: a tag closes before "!"


@dataclass
class Run:
    """Text to translate: ``text`` as the model reads it, ``raw`` what the input had for each
    of its characters (an entity for the character it stands for, "" for the further
    characters of one standing for several), ``marks`` (position in ``text``, markup) in input
    order."""

    text: str = ""
    raw: list[str] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)

    def add_text(self, text: str, raw: str | None = None) -> None:
        """``text``, written ``raw`` in the input (``text`` itself by default)."""
        self.text += text
        self.raw.extend(text if raw is None else [raw] + [""] * (len(text) - 1))

    def add_mark(self, markup: str) -> None:
        self.marks.append((len(self.text), markup))


class Document:
    """``parts`` (strings copied as they are, and runs) cut into ``units``, the sentences to
    translate, in ``language``'s rules; ``escape`` turns a translation into the document's
    text (HTML's escapes); ``collapse`` sends a sentence's inner whitespace as single spaces
    (HTML, where line breaks in text are only layout)."""

    def __init__(
        self,
        parts: list[str | Run],
        language: str,
        fits: Callable[[str], bool],
        lines_end_sentences: bool,
        escape: Callable[[str], str] = str,
        collapse: bool = False,
    ) -> None:
        self.escape = escape
        self.parts: list[str | tuple[Run, list[Segment]]] = []
        self.units: list[str] = []
        for part in parts:
            if isinstance(part, str):
                self.parts.append(part)
                continue
            cut = segments(part.text, language, fits, lines_end_sentences)
            self.parts.append((part, cut))
            for segment in cut:
                if segment.translate:
                    unit = part.text[segment.core_start : segment.core_end]
                    self.units.append(" ".join(unit.split()) if collapse else unit)

    def assemble(self, translations: list[str]) -> str:
        """The document with each unit replaced by its translation (one for each, in order)."""
        if len(translations) != len(self.units):
            raise ValueError(f"{len(translations)} translations for {len(self.units)} units")
        given = iter(translations)
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            run, cut = part
            if not cut:  # no text: only marks
                out.extend(markup for _, markup in run.marks)
            marks = list(run.marks)
            for number, segment in enumerate(cut):
                last = number == len(cut) - 1
                mine = [m for m in marks if last or m[0] <= segment.end]
                marks = marks[len(mine) :]
                if not segment.translate:
                    out.append(_interleave(run, segment.start, segment.end, mine))
                    continue
                before = [m for m in mine if m[0] <= segment.core_start]
                after = [m for m in mine if m[0] >= segment.core_end]
                inside = mine[len(before) : len(mine) - len(after)]
                out.append(_interleave(run, segment.start, segment.core_start, before))
                start = segment.core_start
                inside = [(at - start, markup) for at, markup in inside]
                sentence = run.text[start : segment.core_end]
                out.append(self._placed(next(given), inside, sentence))
                out.append(_interleave(run, segment.core_end, segment.end, after))
        return "".join(out)

    def _placed(self, translation: str, marks: list[tuple[int, str]], sentence: str) -> str:
        """``translation`` of ``sentence`` with ``marks`` (positions in ``sentence``) put at the
        same place counted in words: after word k of n, a mark goes after word round(k*m/n) of
        the translation's m words (at that word's end if it touched a word's end in the
        source, else at the next word's start; one that stood alone between blanks goes
        between the two words with a blank on each side), in their order."""
        if not marks:
            return self.escape(translation)
        source_ends = [word.end() for word in WORD.finditer(sentence)]
        words = [word.span() for word in WORD.finditer(translation)]
        out, position = [], 0
        for at, markup in marks:
            before = sum(1 for end in source_ends if end <= at)
            index = int(before * len(words) / max(1, len(source_ends)) + 0.5)
            closing = not sentence[at - 1].isspace()
            alone = not closing and sentence[at].isspace()
            if closing or alone:
                edge = words[index - 1][1] if index > 0 else 0
            else:
                edge = words[index][0] if index < len(words) else len(translation)
            edge = max(position, edge)
            if alone:  # blanks on both sides, as in the source
                space_after = edge < len(translation) and not translation[edge].isspace()
                markup = (" " if edge else "") + markup + (" " if space_after else "")
            out.append(self.escape(translation[position:edge]) + markup)
            position = edge
        out.append(self.escape(translation[position:]))
        return "".join(out)


def _interleave(run: Run, start: int, end: int, marks: list[tuple[int, str]]) -> str:
    """The input's own ``run`` from ``start`` to ``end`` with ``marks`` where they were."""
    out, position = [], start
    for at, markup in marks:
        out.append("".join(run.raw[position:at]) + markup)
        position = at
    out.append("".join(run.raw[position:end]))
    return "".join(out)

"""``--split-sentences``: a corpus of documents, one a line, each line cut into sentences by the
server's segmenter and rules (beamplugin.serving.documents: sentencex in the source language's
rules, a sentence too long for the model cut at a blank), each sentence translated as a line of
its own, and the line put back together with its own whitespace between the translations."""

from __future__ import annotations

from collections.abc import Callable

from beamplugin.serving.documents.document import Document
from beamplugin.serving.documents.translation import text_document

SURROGATE = range(0xDC80, 0xDD00)  # a byte that is not UTF-8, as surrogateescape decodes it


class LineDocument:
    """One line as what is translated: ``units``, the line itself, or with ``document`` its
    sentences (none where it has no letter: numbers, blanks, copied as they are)."""

    def __init__(self, units: list[str], document: Document | None) -> None:
        self.units, self._document = units, document

    @classmethod
    def whole(cls, line: str) -> LineDocument:
        return cls([line], None)

    @classmethod
    def split(cls, line: str, language: str, fits: Callable[[str], bool]) -> LineDocument:
        """``line`` cut into sentences in ``language``'s rules, each one that ``fits`` the model;
        a line that is not UTF-8 stays whole, and the line encoder refuses it as it would
        without splitting."""
        if any(ord(c) in SURROGATE for c in line):
            return cls.whole(line)
        document = text_document(line, language, fits)
        return cls(document.units, document)

    def assemble(self, translations: list[str]) -> str:
        """The line's translation: ``translations`` (one for each unit, in order) with the
        line's own whitespace around them."""
        if self._document is None:
            return translations[0]
        return self._document.assemble(translations)

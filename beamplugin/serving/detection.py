"""The language of a text, among the model's source languages: py3langid's Naive Bayes model
(shipped in its package, 140 languages; docs/dependencies.md says why this detector), for
``POST /detect`` and ``source: "auto"``.

The model scores every language it knows, and a confidence is the probability it gives a
language among all of them, so an English text sent to a German-only server is answered
"de" with a confidence near 0 rather than a sure "de". Its file is read on first use (about a
second), not at start: a server that is never asked pays nothing.
"""

from __future__ import annotations

from functools import cached_property

import langcodes
from langcodes.tag_parser import LanguageTagError
from py3langid.langid import MODEL_FILE, LanguageIdentifier

# Characters read from a text: plenty to tell its language, and a megabyte-long document is
# not walked character by character in Python on the event loop.
SAMPLE = 4000


class LanguageDetector:
    """Detects which of ``sources`` (the model's language codes: ``de``, mBART's ``de_DE``,
    NLLB's ``deu_Latn``) a text is in; ``codes`` maps those the detector knows to its own."""

    def __init__(self, sources: list[str]) -> None:
        self._sources = sources

    @cached_property
    def identifier(self) -> LanguageIdentifier:
        return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)  # probabilities

    @cached_property
    def codes(self) -> dict[str, str]:
        known = set(self.identifier.labels)
        found = {code: _detector_code(code) for code in self._sources}
        return {code: label for code, label in found.items() if label in known}

    def detect(self, text: str, among: list[str] | None = None) -> list[tuple[str, float]]:
        """Each of the sources (or of ``among`` them) that the detector knows, most likely
        first, with its confidence in percent, from the first ``SAMPLE`` characters."""
        scores = dict(self.identifier.rank(text[:SAMPLE]))
        codes = self.codes
        candidates = [code for code in (among or self._sources) if code in codes]
        ranked = [(code, round(100 * scores[codes[code]], 2)) for code in candidates]
        return sorted(ranked, key=lambda item: -item[1])


def _detector_code(code: str) -> str:
    """A model's code as the detector names languages: the shortest ISO 639 code of the part
    before any ``_`` (``deu_Latn`` -> ``de``, ``en_XX`` -> ``en``)."""
    base = code.partition("_")[0]
    try:
        return langcodes.standardize_tag(base)
    except LanguageTagError:
        return base

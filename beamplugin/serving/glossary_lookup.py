"""A request's glossary found in its sentences: the request's own terms (cut by the server's
tokenizer and BPE) or the name of a glossary loaded at the start, looked up in each sentence,
and the constraints that the terms found make (beamplugin.serving.glossary)."""

from __future__ import annotations

from collections.abc import Callable

from beamplugin.search.constraints import Constraints
from beamplugin.serving.glossary import Glossary, Term, constraints_of
from beamplugin.serving.responses import Refused
from beamplugin.serving.translator import Translator

TermsFinder = Callable[[str], list[Term]]  # a sentence -> the glossary's terms found in it


class GlossaryLookup:
    """The glossaries a request may use on ``translator``: its own terms, or one of ``loaded``
    by its name."""

    def __init__(self, translator: Translator, loaded: dict[str, Glossary]) -> None:
        self.translator = translator
        self.loaded = loaded

    def finder(self, glossary: list[tuple[str, str]] | str | None) -> TermsFinder | None:
        """What finds a sentence's terms of a request's ``glossary`` (its terms or the name of
        one loaded at the start); None without one; 400 for terms the model cannot read."""
        if glossary is None:
            return None
        if isinstance(glossary, str):
            terms = self.loaded[glossary]
        else:
            try:
                terms = self.translator.glossary(glossary)
            except ValueError as error:
                raise Refused(400, f"'glossary': {error}") from None
        return lambda text: terms.find(self.translator.pieces(text))


def sentence_terms(
    find_terms: TermsFinder | None, sentences: list[str]
) -> tuple[list[list[Term]], list[Constraints | None] | None]:
    """The glossary's terms found in each of ``sentences`` and the constraints they make (a
    sentence without terms: None); no terms and no constraints without a glossary."""
    if find_terms is None:
        return [[] for _ in sentences], None
    applied = [find_terms(sentence) for sentence in sentences]
    return applied, [constraints_of(terms) or None for terms in applied]

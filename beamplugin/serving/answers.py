"""What the translation endpoints answer: the JSON bodies of ``/translate`` (LibreTranslate's)
and ``/v1/translate``, made of the translations, the glossary terms found in each text and what
the request asked for (beamplugin.serving.requests)."""

from __future__ import annotations

from typing import Any

from beamplugin.serving.glossary import Term
from beamplugin.serving.requests import LibreRequest, NbestRequest
from beamplugin.serving.translator import Translation


def libre_answer(
    ask: LibreRequest, texts: list[list[str]], applied: list[list[Term]]
) -> dict[str, Any]:
    """LibreTranslate's answer: ``texts`` (per text of ``q``, its translation and then its
    alternatives), a value rather than a list when ``q`` was a string."""
    answer: dict[str, Any] = {"translatedText": [t[0] for t in texts]}
    if ask.alternatives:
        answer["alternatives"] = [t[1:] for t in texts]
    if ask.glossary is not None:
        answer["glossaryApplied"] = [_applied(terms) for terms in applied]
    if ask.single:
        answer = {key: value[0] for key, value in answer.items()}
    if ask.detected is not None:
        answer["detectedLanguage"] = {"language": ask.detected[0],
                                      "confidence": ask.detected[1]}  # fmt: skip
    return answer


def nbest_answer(
    ask: NbestRequest, translations: list[list[Translation]], applied: list[list[Term]]
) -> dict[str, Any]:
    """Per sentence, in order, its hypotheses (and the glossary's terms found in it)."""
    answers = []
    for hypotheses, terms in zip(translations, applied, strict=True):
        answer: dict[str, Any] = {
            "hypotheses": [_hypothesis(h, ask.alignment) for h in hypotheses]
        }
        if ask.glossary is not None:
            answer["glossaryApplied"] = _applied(terms)
        answers.append(answer)
    return {"translations": answers}


def _applied(terms: list[Term]) -> list[dict[str, str]]:
    return [{"source": t.source, "target": t.target} for t in terms]


def _hypothesis(translation: Translation, alignment: bool) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "text": translation.text,
        "pieces": translation.pieces,
        "score": translation.score,
        "positional_scores": translation.positional_scores,
    }
    if alignment:
        answer["alignment"] = translation.alignment
    return answer

"""What a translation request asks for: its body read as a dict (JSON or a URL-encoded form, as
LibreTranslate takes both) and each endpoint's fields checked into a plain object, or
:class:`Refused` with 400 (415 for a body of another type) saying which field is wrong."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from beamplugin.fairseq_plugin.language_pairs import LanguagePairs, Pair
from beamplugin.serving.responses import Refused
from beamplugin.serving.translator import Translator


@dataclass(frozen=True)
class Served:
    """What the server translates: the language pairs of its models, the beam (the most
    hypotheses a request may ask for), the default n-best and whether it prints alignments."""

    languages: LanguagePairs
    beam: int
    nbest: int
    aligns: bool

    @classmethod
    def of(cls, translator: Translator) -> Served:
        return cls(translator.languages, translator.beam, translator.nbest, translator.aligns)

    def pair(self, body: dict[str, Any], required: bool) -> Pair:
        """The pair of the body's ``source`` and ``target`` (required, or else the default
        pair's where absent), or Refused: a pair the models do not translate, or ``source``
        ``auto`` with more than one source language (no language identifier is configured)."""
        given = body.get("source"), body.get("target")
        if required and None in given:
            raise Refused(400, "'source' and 'target' are required (language codes)")
        if not all(isinstance(code, str) for code in given if code is not None):
            raise Refused(400, "'source' and 'target' are language codes (strings)")
        languages = self.languages
        source, target = (d if g is None else g for g, d in zip(given, languages.default,
                                                                 strict=True))  # fmt: skip
        if source == "auto":
            sources = languages.sources()
            if len(sources) > 1:
                raise Refused(400, "'source': 'auto' needs a language identifier and this "
                                   "server has none: give the source language (GET /languages)")
            source = sources[0]
        if not languages.knows((source, target)):
            raise Refused(400, f"the model does not translate {source} to {target} "
                               "(GET /languages lists what it does)")  # fmt: skip
        return source, target


@dataclass(frozen=True)
class LibreRequest:
    """LibreTranslate's ``/translate``: ``q`` a string (``single``) or a list of strings,
    ``alternatives`` more hypotheses per line, in ``pair`` (``source`` and ``target``).
    ``format`` "text" or "html"; ``split``: each string is a document cut into sentences
    (always for HTML; for text unless ``split_sentences`` is false, when each string is one
    sentence)."""

    lines: list[str]
    single: bool
    alternatives: int
    detect_source: bool
    pair: Pair
    format: str
    split: bool

    @classmethod
    def parse(cls, body: dict[str, Any], served: Served) -> LibreRequest:
        pair = served.pair(body, required=True)
        q = body.get("q")
        if not (isinstance(q, str) or _strings(q)):
            raise Refused(400, "'q' is required: a string or a list of strings")
        text_format = body.get("format", "text")
        if text_format not in ("text", "html"):
            raise Refused(400, "'format' must be 'text' or 'html'")
        split = text_format == "html" or boolean_field(body, "split_sentences", True)
        alternatives = integer_field(body, "alternatives", 0, 0, served.beam - 1)
        single = isinstance(q, str)
        lines = [q] if single else q
        if split:  # a document of nothing but blanks has no sentence to stand for it
            for index, line in enumerate(lines):
                if not line.strip():
                    raise Refused(400, f"'q' {'' if single else f'item {index} '}is empty: "
                                       "there is nothing to translate")  # fmt: skip
        detect = body.get("source") == "auto"
        return cls(lines, single, alternatives, detect, pair, text_format, split)


@dataclass(frozen=True)
class NbestRequest:
    """``/v1/translate``: ``sentences``, ``nbest`` hypotheses of each, with ``alignment``, in
    ``pair`` (the default one unless ``source``/``target`` say)."""

    sentences: list[str]
    nbest: int
    alignment: bool
    pair: Pair

    @classmethod
    def parse(cls, body: dict[str, Any], served: Served) -> NbestRequest:
        pair = served.pair(body, required=False)
        sentences = body.get("sentences")
        if not _strings(sentences):
            raise Refused(400, "'sentences' is required: a list of strings")
        nbest = integer_field(body, "nbest", served.nbest, 1, served.beam)
        alignment = body.get("alignment", False)
        if not isinstance(alignment, bool):
            raise Refused(400, "'alignment' must be true or false")
        if alignment and not served.aligns:
            raise Refused(400, "alignments are served when the server runs with --print-alignment")
        return cls(sentences, nbest, alignment, pair)


def _strings(value: Any) -> bool:
    """Whether ``value`` is a list of strings."""
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


async def read_body(request: web.Request) -> dict[str, Any]:
    """A JSON object, or a URL-encoded form, as a dict."""
    raw = await request.read()  # 413 past client_max_size
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refused(
            400, f"the body is not valid UTF-8: byte 0x{raw[error.start]:02x} at {error.start}"
        ) from None
    if request.content_type == "application/x-www-form-urlencoded":
        try:
            fields = urllib.parse.parse_qs(text, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            raise Refused(400, "the form has a value that is not valid UTF-8") from None
        return {key: values[-1] for key, values in fields.items()}
    if request.content_type not in ("application/json", "application/octet-stream"):
        raise Refused(415, "send JSON (Content-Type: application/json) or a URL-encoded form")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise Refused(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


def integer_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """``body[name]`` (``default`` if absent) as an integer in ``low..high``; a form's digits
    count."""
    value = body.get(name, default)
    if isinstance(value, str) and value.strip().isdigit():  # from a form
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"'{name}' must be an integer from {low} to {high}")
    return value


def boolean_field(body: dict[str, Any], name: str, default: bool) -> bool:
    """``body[name]`` (``default`` if absent) as true or false; a form's "true"/"false" (or
    "1"/"0") count."""
    value = body.get(name, default)
    if isinstance(value, str):  # from a form
        value = {"true": True, "1": True, "false": False, "0": False}.get(value.strip().lower())
    if not isinstance(value, bool):
        raise Refused(400, f"'{name}' must be true or false")
    return value

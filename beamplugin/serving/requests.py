"""What a translation request asks for: its body read as a dict (JSON or a URL-encoded form, as
LibreTranslate takes both) and each endpoint's fields checked into a plain object, or
:class:`Refused` with 400 (415 for a body of another type) saying which field is wrong."""

from __future__ import annotations

import html
import io
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import docx
import odfdo
from aiohttp import web
from docx.document import Document as DocxDocument
from docx.section import _BaseHeaderFooter as BaseHeaderFooter
from docx.table import _Cell
from docx.text.paragraph import Paragraph

from beamplugin.fairseq_plugin.language_pairs import LanguagePairs, Pair
from beamplugin.serving.detection import LanguageDetector
from beamplugin.serving.responses import Refused
from beamplugin.serving.translator import Translator

Detected = tuple[str, float]  # a source language found by the detector, its confidence (%)
MARKUP = re.compile(r"<[^>]*>")


@dataclass(frozen=True)
class Served:
    """What the server translates: the language pairs of its models, the beam (the most
    hypotheses a request may ask for), the default n-best, whether it prints alignments, the
    detector of its source languages, how it meets glossaries (``constraints``: fairseq's
    --constraints, None: it does not), the most terms a request's glossary may have and the
    names of the glossaries it loaded."""

    languages: LanguagePairs
    beam: int
    nbest: int
    aligns: bool
    detector: LanguageDetector = field(compare=False)
    constraints: str | None = None
    glossary_terms: int = 0
    glossary_names: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, translator: Translator, glossary_terms: int = 0, glossary_names: tuple[str, ...] = ()
    ) -> Served:
        languages = translator.languages
        return cls(languages, translator.beam, translator.nbest, translator.aligns,
                   LanguageDetector(languages.sources()), translator.constraints,
                   glossary_terms, glossary_names)  # fmt: skip

    def pair(
        self, body: dict[str, Any], required: bool, texts: list[str]
    ) -> tuple[Pair, Detected | None]:
        """The pair of the body's ``source`` and ``target`` (required, or else the default
        pair's where absent), or Refused: a pair the models do not translate. ``source``
        ``auto``: the language of ``texts`` among the sources that translate to the target
        (also returned, with its confidence)."""
        given = body.get("source"), body.get("target")
        if required and None in given:
            raise Refused(400, "'source' and 'target' are required (language codes)")
        if not all(isinstance(code, str) for code in given if code is not None):
            raise Refused(400, "'source' and 'target' are language codes (strings)")
        languages = self.languages
        source, target = (d if g is None else g for g, d in zip(given, languages.default,
                                                                 strict=True))  # fmt: skip
        detected = self._detect(texts, target) if source == "auto" else None
        if detected is not None:
            source = detected[0]
        if not languages.knows((source, target)):
            raise Refused(400, f"the model does not translate {source} to {target} "
                               "(GET /languages lists what it does)")  # fmt: skip
        return (source, target), detected

    def _detect(self, texts: list[str], target: str) -> Detected:
        """The most likely language of ``texts`` (all of a request's together) among the
        sources that translate to ``target``."""
        sources = [s for s in self.languages.sources() if self.languages.knows((s, target))]
        if not sources:
            raise Refused(400, f"the model translates no language to {target} "
                               "(GET /languages lists what it does)")  # fmt: skip
        found = self.detector.detect(" ".join(texts), among=sources)
        if found:
            return found[0]
        if len(sources) == 1:  # one the detector does not know: it can only be that one
            return sources[0], 0.0
        raise Refused(400, f"'source': 'auto': the language detector knows none of "
                           f"{', '.join(sources)}: give the source language")  # fmt: skip


@dataclass(frozen=True)
class LibreRequest:
    """LibreTranslate's ``/translate``: ``q`` a string (``single``) or a list of strings,
    ``alternatives`` more hypotheses per line, in ``pair`` (``source`` and ``target``; with
    ``source: "auto"``, ``detected``). ``format`` "text" or "html"; ``split``: each string is
    a document cut into sentences (always for HTML; for text unless ``split_sentences`` is
    false, when each string is one sentence). ``glossary``: (source, target) terms, the name
    of one the server loaded, or None."""

    lines: list[str]
    single: bool
    alternatives: int
    detected: Detected | None
    pair: Pair
    format: str
    split: bool
    glossary: list[tuple[str, str]] | str | None

    @classmethod
    def parse(cls, body: dict[str, Any], served: Served) -> LibreRequest:
        q = body.get("q")
        if not (isinstance(q, str) or _strings(q)):
            raise Refused(400, "'q' is required: a string or a list of strings")
        text_format = body.get("format", "text")
        if text_format not in ("text", "html"):
            raise Refused(400, "'format' must be 'text' or 'html'")
        single = isinstance(q, str)
        lines = [q] if single else q
        texts = lines
        if text_format == "html":  # its language is its text's: tags out, entities read
            texts = [html.unescape(MARKUP.sub(" ", line)) for line in lines]
        pair, detected = served.pair(body, required=True, texts=texts)
        split = text_format == "html" or boolean_field(body, "split_sentences", True)
        alternatives = integer_field(body, "alternatives", 0, 0, served.beam - 1)
        for index, line in enumerate(lines if split else []):  # sentences: the encoder says it
            where = "'q'" if single else f"'q' item {index}"
            if not line.strip():  # a document of nothing but blanks has no sentence
                raise Refused(400, f"{where} is empty: there is nothing to translate")
            _check_encodable(line, where)
        glossary = glossary_field(body, served)
        return cls(lines, single, alternatives, detected, pair, text_format, split, glossary)


# LibreTranslate's file formats this server translates, each read as what it holds
FILE_FORMATS = {".txt": "text", ".html": "html", ".htm": "html", ".srt": "srt", ".docx": "docx",
                ".odt": "odt"}  # fmt: skip
SAFE_NAME = re.compile(r"[^\w.-]+", re.ASCII)  # a name for a URL and a header


@dataclass(frozen=True)
class FileRequest:
    """``POST /translate_file``: the uploaded ``file``, ``data``, in ``format`` ("text",
    "html", "srt", "docx" or "odt", by its extension) to translate in ``pair``; ``text`` what
    it says (for a .docx or .odt, its paragraphs' text, a line each); ``name`` its name made
    safe for a URL."""

    name: str
    format: str
    data: bytes
    text: str
    pair: Pair

    @classmethod
    def parse(cls, fields: dict[str, Any], served: Served) -> FileRequest:
        upload = fields.get("file")
        if not isinstance(upload, web.FileField):
            raise Refused(400, "'file' is required: a file sent as multipart/form-data")
        name = SAFE_NAME.sub("_", upload.filename.replace("\\", "/").rsplit("/", 1)[-1])
        extension = "." + name.rpartition(".")[2].lower() if "." in name else ""
        if extension not in FILE_FORMATS:
            raise Refused(400, f"'file': {extension or 'a name without extension'} is not "
                               f"translated; these are: {', '.join(FILE_FORMATS)}")  # fmt: skip
        data = upload.file.read()
        text_format = FILE_FORMATS[extension]
        read = {"docx": _docx_text, "odt": _odt_text}.get(text_format, _utf8)
        text = read(data)
        if not text.strip():
            raise Refused(400, "'file' is empty: there is nothing to translate")
        detected = html.unescape(MARKUP.sub(" ", text)) if text_format == "html" else text
        pair, _ = served.pair(fields, required=True, texts=[detected])
        return cls(name, text_format, data, text, pair)


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte order mark is not text
    except UnicodeDecodeError as error:
        raise Refused(400, f"'file' is not valid UTF-8: byte 0x{data[error.start]:02x} at "
                           f"{error.start}") from None  # fmt: skip


def _docx_text(data: bytes) -> str:
    """The text of a .docx's paragraphs, a line each, or 400 if it is not one."""
    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as error:  # a zip or XML error, or a zip that is not a document
        raise Refused(400, f"'file' is not a .docx document: {error}") from None
    return "\n".join(paragraph.text for paragraph in docx_paragraphs(document))


def _odt_text(data: bytes) -> str:
    """The text of an .odt's paragraphs and headings, a line each, or 400 if it is not one."""
    try:
        document = odfdo.Document(io.BytesIO(data))
        kind = document.get_type()
    except Exception:  # odfdo's errors on garbage say little: a TypeError, a KeyError
        raise Refused(400, "'file' is not an OpenDocument text (.odt)") from None
    if kind != "text":
        raise Refused(400, f"'file' is not an OpenDocument text (.odt): it holds a {kind}")
    return "\n".join(str(paragraph).rstrip("\n") for paragraph in odt_paragraphs(document))


def odt_paragraphs(document: odfdo.Document) -> list[odfdo.Element]:
    """The paragraphs and headings of an .odt's text, in document order (nested ones too: a
    table cell's, a note's, a text frame's)."""
    return list(document.body.get_elements("descendant::text:p | descendant::text:h"))


def docx_paragraphs(document: DocxDocument) -> list[Paragraph]:
    """The paragraphs of a .docx's body, of its sections' headers and footers (first-page and
    even-page ones too) and of their tables (nested ones too), each once."""
    found: list[Paragraph] = []
    seen: set[int] = set()  # a merged cell is every cell it covers: its paragraphs once

    def walk(container: DocxDocument | _Cell | BaseHeaderFooter) -> None:
        for paragraph in container.paragraphs:
            if id(paragraph._p) not in seen:
                seen.add(id(paragraph._p))
                found.append(paragraph)
        for table in container.tables:
            for row in table.rows:
                for cell in row.cells:
                    walk(cell)

    walk(document)
    for section in document.sections:
        for part in (section.header, section.footer, section.first_page_header,
                     section.first_page_footer, section.even_page_header,
                     section.even_page_footer):  # fmt: skip
            # a linked one is the previous section's (reading it would add one of its own)
            if not part.is_linked_to_previous:
                walk(part)
    return found


async def read_file_form(request: web.Request) -> dict[str, Any]:
    """A multipart form's fields (a file as aiohttp's FileField), or 415 for another body."""
    if request.content_type != "multipart/form-data":
        raise Refused(415, "send the file as multipart/form-data")
    try:
        return dict(await request.post())
    except web.HTTPRequestEntityTooLarge:  # aiohttp's message names no file and no option
        raise Refused(413, f"the file is too large: a request may have at most "
                           f"{request.client_max_size} bytes (--max-body-bytes)") from None


def glossary_field(body: dict[str, Any], served: Served) -> list[tuple[str, str]] | str | None:
    """``body["glossary"]``: the name of a glossary the server loaded, or a list of
    ``{"source": ..., "target": ...}`` (in a form, as JSON text), each side a non-blank
    string, each source once, at most ``served.glossary_terms``; None if absent."""
    value = body.get("glossary")
    if value is None:
        return None
    if served.constraints is None:
        raise Refused(400, "this server does not apply glossaries (it runs without --constraints)")
    if isinstance(value, str) and value.lstrip().startswith("["):  # a form's JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if isinstance(value, str):
        if value not in served.glossary_names:
            names = ", ".join(served.glossary_names) or "none"
            raise Refused(400, f"'glossary': no glossary is named {value!r} (the server's: "
                               f"{names})")  # fmt: skip
        return value
    shape = (
        "'glossary' must be a glossary's name or a list of "
        "{\"source\": \"...\", \"target\": \"...\"}"
    )
    if not isinstance(value, list):
        raise Refused(400, shape)
    if len(value) > served.glossary_terms:
        raise Refused(400, f"'glossary' has {len(value)} terms: at most "
                           f"{served.glossary_terms} are taken")  # fmt: skip
    terms: list[tuple[str, str]] = []
    for index, entry in enumerate(value):
        if not (isinstance(entry, dict) and _strings([entry.get("source"), entry.get("target")])):
            raise Refused(400, shape)
        source, target = entry["source"].strip(), entry["target"].strip()
        if not source or not target:
            raise Refused(400, f"'glossary' item {index} has an empty term")
        if any(source == known for known, _ in terms):
            raise Refused(400, f"'glossary' item {index}: the source term {source!r} is there "
                               "twice")  # fmt: skip
        terms.append((source, target))
    return terms


@dataclass(frozen=True)
class NbestRequest:
    """``/v1/translate``: ``sentences``, ``nbest`` hypotheses of each, with ``alignment``, in
    ``pair`` (the default one unless ``source``/``target`` say), under ``glossary`` (as
    /translate's)."""

    sentences: list[str]
    nbest: int
    alignment: bool
    pair: Pair
    glossary: list[tuple[str, str]] | str | None = None

    @classmethod
    def parse(cls, body: dict[str, Any], served: Served) -> NbestRequest:
        sentences = body.get("sentences")
        if not _strings(sentences):
            raise Refused(400, "'sentences' is required: a list of strings")
        pair, _ = served.pair(body, required=False, texts=sentences)
        nbest = integer_field(body, "nbest", served.nbest, 1, served.beam)
        alignment = body.get("alignment", False)
        if not isinstance(alignment, bool):
            raise Refused(400, "'alignment' must be true or false")
        if alignment and not served.aligns:
            raise Refused(400, "alignments are served when the server runs with --print-alignment")
        return cls(sentences, nbest, alignment, pair, glossary_field(body, served))


def _check_encodable(text: str, where: str) -> None:
    """Refuse a document that is not valid UTF-8 (a JSON ``\\ud800`` escape is a lone
    surrogate, which the segmenter fails on)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise Refused(400, f"{where} is not valid UTF-8: the lone surrogate U+{code:04X} at "
                           f"character {error.start}") from None  # fmt: skip


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

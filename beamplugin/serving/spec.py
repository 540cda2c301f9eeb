"""The server's OpenAPI 3.1 description (``GET /spec``): every endpoint with its request, its
answers and its errors, for one server's settings (language pair, beam, limits, keys).

Written out by hand rather than generated from the handlers: the handlers read loosely typed
bodies (JSON or a form, LibreTranslate's ``q`` a string or a list), which a schema states more
plainly than decorators would; the tests check every answer of a real server against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ERROR = {"$ref": "#/components/schemas/Error"}


@dataclass(frozen=True)
class SpecSettings:
    """What the description says of one server."""

    default: tuple[str, str]  # the pair of a request that names none
    sources: list[str]
    targets: list[str]
    beam: int
    nbest: int
    max_request_sentences: int
    keys: bool  # API keys required
    metrics_open: bool
    char_limit: int | None
    aligns: bool
    glossary_terms: int | None  # the most terms of a glossary; None: glossaries not served
    glossary_names: tuple[str, ...]  # the glossaries loaded at the start


def openapi(settings: SpecSettings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server with ``settings``."""
    return {
        "openapi": "3.1.0",
        "info": _info(settings),
        "paths": _paths(settings),
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(settings),
        },
    }


def _info(s: SpecSettings) -> dict[str, Any]:
    return {
        "title": "beamplugin-serve",
        "version": "1",
        "description": (
            f"Translation {_languages(s)} with fairseq models and beam search "
            f"(beam {s.beam}); each translation is what fairseq-interactive prints for the "
            "line. Errors are answered as {\"error\": \"...\"}."
            + (" Translation requests need an API key: 'api_key' in the body or "
               "'Authorization: Bearer KEY'." if s.keys else "")
        ),  # fmt: skip
    }


def _paths(s: SpecSettings) -> dict[str, Any]:
    """Every endpoint: its request, its answers, its errors."""
    security = [{"bearer": []}, {}] if s.keys else []
    translation_errors = _translation_errors(s)
    return {
        "/translate": {"post": {
            "summary": "Translate (LibreTranslate's API)",
            "security": security,
            "requestBody": _body(_libre_request(s)),
            "responses": {
                "200": _json("The translations", {"$ref": "#/components/schemas/Libre"}),
                **translation_errors,
            },
        }},  # fmt: skip
        "/v1/translate": {"post": {
            "summary": "Translate, with n-best lists, scores and alignments",
            "security": security,
            "requestBody": _body(_v1_request(s)),
            "responses": {
                "200": _json("Per sentence, in order, its best hypotheses",
                             {"$ref": "#/components/schemas/NBest"}),
                **translation_errors,
            },  # fmt: skip
        }},
        "/detect": {"post": {
            "summary": "The language of a text, among the model's source languages "
                       "(LibreTranslate's)",
            "security": security,
            "requestBody": _body({
                "type": "object", "required": ["q"],
                "properties": {"q": {"type": "string"}, "api_key": {"type": "string"}},
            }),
            "responses": {
                "200": _json("The source languages the detector knows, most likely first", {
                    "type": "array", "items": {"$ref": "#/components/schemas/Detected"},
                }),
                **_errors(
                    (400, "No text, or more characters than --char-limit"),
                    (403, "No API key, or an unknown one") if s.keys else None,
                    (413, "The body is larger than --max-body-bytes"),
                    (415, "The body is neither JSON nor a URL-encoded form"),
                    (429, "Over the key's (or the client address's) requests per minute", True),
                ),
            },
        }},  # fmt: skip
        "/translate_file": {"post": {
            "summary": "Translate a file (LibreTranslate's): .txt and .html as /translate's "
                       "text and html, .srt one cue a sentence, numbering and timings kept, "
                       ".docx and .odt their paragraphs, runs and the rest kept",
            "security": security,
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                "type": "object", "required": ["file", "source", "target"],
                "properties": {
                    "file": {"type": "string", "contentMediaType": "application/octet-stream",
                             "description": ".txt, .html, .htm or .srt (UTF-8), .docx or .odt"},
                    **_pair(s, optional=False),
                    "api_key": {"type": "string"},
                },
            }}}},
            "responses": {
                "200": _json("Where to download the translated file, of the same format, for "
                             "10 minutes (the 100 newest files are kept)", {
                    "type": "object", "required": ["translatedFileUrl"],
                    "properties": {"translatedFileUrl": {"type": "string", "format": "uri"}},
                    "additionalProperties": False,
                }),
                **_translation_errors(s, "The body is not multipart/form-data",
                                      "no file, an extension not listed, an empty file or "
                                      "one not UTF-8, a .srt, .docx or .odt that does not parse"),
            },
        }},
        "/download_file/{key}/{name}": {"get": {
            "summary": "A file /translate_file translated (its URL is its key: no API key)",
            "parameters": [{"name": name, "in": "path", "required": True,
                            "schema": {"type": "string"}} for name in ("key", "name")],
            "responses": {
                "200": {"description": "The file", "content": {
                    media: {"schema": {"type": "string"}}
                    for media in ("text/plain", "text/html", "application/x-subrip",
                                  "application/vnd.openxmlformats-officedocument"
                                  ".wordprocessingml.document")
                }},
                **_errors((404, "No such file, or no longer: files are kept 10 minutes")),
            },
        }},
        "/languages": {"get": {
            "summary": "The language pairs (LibreTranslate's)",
            "responses": {"200": _json("Each source language, its name and its targets", {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["code", "name", "targets"],
                    "properties": {
                        "code": {"type": "string"}, "name": {"type": "string"},
                        "targets": {"type": "array", "items": {"type": "string"}},
                    },
                },
            })},
        }},  # fmt: skip
        "/health": {"get": {
            "summary": "Whether the server translates (open, for load balancers)",
            "responses": {
                "200": _json("It translates", {"$ref": "#/components/schemas/Health"}),
                "503": _json("It does not: failed, restarting its decoder, or stopping",
                             {"$ref": "#/components/schemas/Health"}),
            },
        }},  # fmt: skip
        "/metrics": {"get": {
            "summary": "Prometheus metrics",
            "security": [] if s.metrics_open else security,
            "responses": {
                "200": {"description": "Prometheus' text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors(None if s.metrics_open else (403, "No API key, or an unknown one")),
            },
        }},  # fmt: skip
        "/spec": {"get": {
            "summary": "This description",
            "responses": {"200": _json("OpenAPI 3.1", {"type": "object"})},
        }},
        "/docs": {"get": {
            "summary": "This description, readable in a browser",
            "responses": {"200": _html("A page that shows /spec")},
        }},
        "/": {"get": {
            "summary": "A page to translate in a browser",
            "responses": {"200": _html("The page")},
        }},
    }


def _translation_errors(
    s: SpecSettings,
    unsupported: str = "The body is neither JSON nor a URL-encoded form",
    bad: str = "",
) -> dict[str, Any]:
    return _errors(
        (400, "Bad input: the message says what (no sentence of the request is queued)"
         + (f"; {bad}" if bad else "")
         + (f"; also more than {s.char_limit} characters in all" if s.char_limit else "")),
        (403, "No API key, or an unknown one") if s.keys else None,
        (413, "The body is larger than --max-body-bytes"),
        (415, unsupported),
        (429, "Over the key's (or the client address's) requests per minute", True),
        (500, "The model failed"),
        (503, "The queue has no room, the server is stopping, or its decoder process is "
              "restarting", True),
        (504, "Not translated within --request-timeout; the request's sentences are cancelled"),
    )  # fmt: skip


def _libre_request(s: SpecSettings) -> dict[str, Any]:
    """LibreTranslate's request body."""
    return {
        "type": "object",
        "required": ["q", "source", "target"],
        "properties": {
            "q": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"},
                     "minItems": 1, "maxItems": s.max_request_sentences},
                ],  # fmt: skip
                "description": "a text, or a list of texts, to translate: each one cut into "
                               "sentences, put back together with its own blanks and line breaks",
            },
            **_pair(s, optional=False),
            "format": {
                "type": "string", "enum": ["text", "html"], "default": "text",
                "description": "html: text nodes translated; tags, attributes, entities, "
                               "comments and <script>, <style>, <code>, translate=\"no\" kept",
            },
            "split_sentences": {
                "type": "boolean", "default": True,
                "description": "format text only; false: each text is one sentence",
            },
            "alternatives": {
                "type": "integer", "minimum": 0, "maximum": s.beam - 1, "default": 0,
                "description": "more translations of each line, from its n-best list",
            },  # fmt: skip
            "glossary": _glossary(s),
            "api_key": {"type": "string"},
        },
    }


def _glossary(s: SpecSettings) -> dict[str, Any]:
    """A request's glossary (in a form: as JSON text)."""
    term = {"type": "string", "minLength": 1}
    if s.glossary_terms is None:
        return {"type": "array", "maxItems": 0,
                "description": "this server runs without --constraints: a glossary gets 400"}
    terms = {
        "type": "array", "maxItems": s.glossary_terms,
        "items": {
            "type": "object", "required": ["source", "target"],
            "properties": {"source": term, "target": term},
        },
    }  # fmt: skip
    named = {"type": "string", "enum": list(s.glossary_names)}
    return {
        "oneOf": [terms, named] if s.glossary_names else [terms],
        "description": "terms, or the name of a glossary loaded with --glossary: a source term "
                       "found in a sentence (on the model's BPE pieces, case as written) puts "
                       "its target term in the sentence's translation; the answer's "
                       "glossaryApplied names those found",
    }  # fmt: skip


def _v1_request(s: SpecSettings) -> dict[str, Any]:
    """The n-best endpoint's request body."""
    return {
        "type": "object",
        "required": ["sentences"],
        "properties": {
            "sentences": {"type": "array", "items": {"type": "string"},
                          "minItems": 1, "maxItems": s.max_request_sentences},  # fmt: skip
            "nbest": {"type": "integer", "minimum": 1, "maximum": s.beam, "default": s.nbest},
            "alignment": {
                "type": "boolean", "default": False,
                "description": "the A- alignment of each hypothesis"
                + ("" if s.aligns else " (this server runs without --print-alignment: 400)"),
            },  # fmt: skip
            **_pair(s, optional=True),
            "glossary": _glossary(s),
            "api_key": {"type": "string"},
        },
    }


def _languages(s: SpecSettings) -> str:
    if len(s.sources) == len(s.targets) == 1:
        return f"{s.sources[0]} to {s.targets[0]}"
    return f"between {len(s.sources)} source and {len(s.targets)} target languages"


def _pair(s: SpecSettings, optional: bool) -> dict[str, Any]:
    """A request's ``source`` and ``target``: a pair GET /languages lists (else 400); when
    ``optional``, the default pair's where absent."""
    source = {"type": "string", "enum": [*s.sources, "auto"],
              "description": "auto: detected among the sources that translate to the target"}
    target = {"type": "string", "enum": s.targets}
    if optional:
        source["default"], target["default"] = s.default
    return {"source": source, "target": target}


def _schemas(s: SpecSettings) -> dict[str, Any]:
    strings = {"type": "array", "items": {"type": "string"}}
    applied = {
        "type": "object",
        "required": ["source", "target"],
        "properties": {"source": {"type": "string"}, "target": {"type": "string"}},
        "additionalProperties": False,
    }
    hypothesis = {
        "type": "object",
        "required": ["text", "pieces", "score", "positional_scores"],
        "properties": {
            "text": {"type": "string", "description": "fairseq-interactive's D- text"},
            "pieces": {"type": "string", "description": "its H- line's (BPE pieces)"},
            "score": {"type": "number", "description": "base-2 log-probability, normalised"},
            "positional_scores": {"type": "array", "items": {"type": "number"}},
            "alignment": {"type": "string", "description": "src-tgt pairs (its A- line)"},
        },
        "additionalProperties": False,
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string"}},
            "additionalProperties": False,
        },
        "Libre": {
            "type": "object",
            "required": ["translatedText"],
            "properties": {
                "translatedText": {"oneOf": [{"type": "string"}, strings]},
                "alternatives": {"oneOf": [strings, {"type": "array", "items": strings}]},
                "detectedLanguage": {"$ref": "#/components/schemas/Detected"},
                "glossaryApplied": {
                    "anyOf": [{"type": "array", "items": applied},
                              {"type": "array", "items": {"type": "array", "items": applied}}],
                    "description": "with a glossary: the terms found in each text (per text "
                                   "when 'q' is a list)",
                },  # fmt: skip
            },
            "additionalProperties": False,
        },
        "Detected": {
            "type": "object",
            "required": ["language", "confidence"],
            "properties": {
                "language": {"type": "string"},
                "confidence": {"type": "number", "minimum": 0, "maximum": 100,
                               "description": "percent, among all the detector's languages"},
            },
            "additionalProperties": False,
        },
        "NBest": {
            "type": "object",
            "required": ["translations"],
            "properties": {
                "translations": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["hypotheses"],
                        "properties": {
                            "hypotheses": {"type": "array", "items": hypothesis,
                                           "minItems": 1, "maxItems": s.beam},  # fmt: skip
                            "glossaryApplied": {
                                "type": "array", "items": applied,
                                "description": "with a glossary: the terms found in the "
                                               "sentence",
                            },  # fmt: skip
                        },
                        "additionalProperties": False,
                    },
                }
            },
            "additionalProperties": False,
        },
        "Health": {
            "type": "object",
            "required": ["status", "queued", "in_flight"],
            "properties": {
                "status": {"enum": ["ok", "failed", "restarting", "stopping"]},
                "queued": {"type": "integer", "minimum": 0},
                "in_flight": {"type": "integer", "minimum": 0},
                "error": {"type": "string"},
            },
            "additionalProperties": False,
        },
    }


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _html(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/html": {"schema": {"type": "string"}}}}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "required": True,
        "content": {
            "application/json": {"schema": schema},
            "application/x-www-form-urlencoded": {"schema": schema},
        },
    }


def _errors(*errors: tuple | None) -> dict[str, Any]:
    """Error answers: (status, description[, with Retry-After]) each; None ones left out."""
    answers = {}
    for error in errors:
        if error is None:
            continue
        status, description, *retry = error
        answer = _json(description, ERROR)
        if retry:
            answer["headers"] = {"Retry-After": {
                "description": "seconds to wait", "schema": {"type": "integer", "minimum": 1},
            }}  # fmt: skip
        answers[str(status)] = answer
    return answers

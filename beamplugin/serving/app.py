"""``beamplugin-serve``: a translation server on the continuous-batching engine.

Many clients, one engine: every sentence of every request goes into one TranslationStream, which
decodes them together with beam search in a process of its own (beamplugin.serving.decoder_process)
while the aiohttp event loop only parses, encodes and answers. Options are fairseq-interactive's
(parsed by fairseq's own parser, ``--user-dir`` and ``--task beam_translation`` implied) plus the
server's own (``--host``, ``--port``, ``--max-queued``, ...); each translation is what
fairseq-interactive prints for the line (its ``D-`` text, base-2 scores).

Endpoints: ``POST /translate`` (LibreTranslate's API: texts and HTML documents, cut into sentences),
``POST /v1/translate`` (n-best lists with scores and alignments), ``POST /detect`` and ``GET
/languages`` (LibreTranslate's), ``POST /translate_file`` (LibreTranslate's: a .txt, .html, .srt,
.docx or .odt file, fetched translated from ``GET /download_file/ID/NAME``), ``GET /health``, ``GET
/metrics`` (Prometheus), ``GET /spec`` (OpenAPI 3.1, beamplugin.serving.spec), ``GET /docs`` (it,
readable) and ``GET /`` (a page to try it). Bad input is answered with a status and ``{"error":
"..."}``: 400, 413 for a body over ``--max-body-bytes``, 415 for a body neither JSON nor a form (nor
multipart for a file), 503 with Retry-After when the queue has no room. Guards
(beamplugin.serving.guards): 403 without a valid API key, 429 with Retry-After over a key's requests
per minute, 400 over the character limit. A client that goes away, or a request not answered within
``--request-timeout`` (504), has its sentences cancelled. SIGTERM (or SIGINT) stops taking requests,
answers every accepted one, then exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from beamplugin.search.constraints import Constraints
from beamplugin.serving.admission import Admission
from beamplugin.serving.documents.files import translate_file
from beamplugin.serving.documents.translation import translate_documents
from beamplugin.serving.downloads import Downloads
from beamplugin.serving.glossary import Glossary, Term, constraints_of
from beamplugin.serving.guards import Guards
from beamplugin.serving.language_names import language_name
from beamplugin.serving.metrics import ServerMetrics
from beamplugin.serving.requests import (
    FileRequest,
    LibreRequest,
    NbestRequest,
    Served,
    read_body,
    read_file_form,
)
from beamplugin.serving.responses import Refused, json_answer
from beamplugin.serving.spec import SpecSettings, openapi
from beamplugin.serving.translator import Translation, Translator

logger = logging.getLogger("beamplugin.serving.app")

PAGE = Path(__file__).with_name("page.html")
DOCS = Path(__file__).with_name("docs.html")
TRANSLATION_ENDPOINTS = ("/translate", "/v1/translate", "/translate_file")
FILE_TYPES = {".txt": "text/plain", ".html": "text/html", ".htm": "text/html",
              ".srt": "application/x-subrip",
              ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
              ".odt": "application/vnd.oasis.opendocument.text"}
BINARY = (".docx", ".odt")  # no charset in their content type


class TranslationService:
    """The HTTP endpoints on one Translator, behind ``guards`` (none by default); a translation
    not answered within ``request_timeout`` seconds gets 504 and its sentences are cancelled;
    a request's glossary has at most ``glossary_terms`` terms, or names one of ``glossaries``
    (those loaded at the start)."""

    def __init__(
        self,
        translator: Translator,
        max_request_sentences: int,
        guards: Guards | None = None,
        request_timeout: float | None = None,
        glossary_terms: int = 32,
        glossaries: dict[str, Glossary] | None = None,
    ) -> None:
        self.translator = translator
        self.glossaries = glossaries or {}
        self.guards = guards or Guards()
        self.metrics = ServerMetrics(translator)
        translator.observe(self.metrics)
        self.admission = Admission(
            translator, self.guards, self.metrics, max_request_sentences, request_timeout
        )
        self.downloads = Downloads()
        self.served = served = Served.of(translator, glossary_terms, tuple(self.glossaries))
        languages = served.languages
        self.spec = openapi(SpecSettings(
            languages.default, languages.sources(), sorted({t for _, t in languages.pairs}),
            served.beam, served.nbest, max_request_sentences,
            keys=self.guards.keys is not None, metrics_open=self.guards.metrics_open,
            char_limit=self.guards.char_limit, aligns=served.aligns,
            glossary_terms=glossary_terms if served.constraints else None,
            glossary_names=served.glossary_names,
        ))  # fmt: skip

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._answer_errors])
        app.router.add_get("/", self.page)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/spec", self.openapi)
        app.router.add_get("/docs", self.docs)
        app.router.add_get("/languages", self.libre_languages)
        app.router.add_post("/translate", self.libre_translate)
        app.router.add_post("/v1/translate", self.translate_nbest)
        app.router.add_post("/detect", self.detect)
        app.router.add_post("/translate_file", self.libre_translate_file)
        app.router.add_get("/download_file/{key}/{name}", self.download_file)
        return app

    @web.middleware
    async def _answer_errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error as JSON; requests counted and translation requests timed."""
        started = time.perf_counter()
        endpoint = request.match_info.route.resource
        path = endpoint.canonical if endpoint is not None else "other"
        try:
            response = await handler(request)
        except Refused as refused:
            if refused.reason is not None:
                self.metrics.rejected.labels(refused.reason).inc()
            response = json_answer(
                {"error": refused.message}, status=refused.status, headers=refused.headers
            )
        except asyncio.CancelledError:  # the client went away; its sentences are cancelled
            self.metrics.requests.labels(path, "499").inc()
            raise
        except web.HTTPException as error:  # aiohttp's own: 404, 405, 413 ...
            if error.status < 400:
                raise
            response = json_answer(
                {"error": error.text or error.reason}, status=error.status, headers={
                    k: v for k, v in error.headers.items() if k.lower() == "allow"
                },
            )  # fmt: skip
        except Exception as error:  # a failing model: the client is told, the server goes on
            logger.exception("%s %s failed", request.method, request.path)
            response = json_answer({"error": f"internal error: {error}"}, status=500)
        self.metrics.requests.labels(path, str(response.status)).inc()
        if path in TRANSLATION_ENDPOINTS:
            self.metrics.latency.labels(path).observe(time.perf_counter() - started)
        if self.admission.stopping:
            response.force_close()
        return response

    # ---- translation -------------------------------------------------------------------------

    async def libre_translate(self, request: web.Request) -> web.Response:
        """LibreTranslate's ``/translate``: ``q`` a string or a list of strings, each a text
        or an HTML document cut into sentences (beamplugin.serving.documents), or with
        ``split_sentences`` false a sentence."""
        body = await read_body(request)
        self.guards.admit(request, body)
        ask = LibreRequest.parse(body, self.served)
        nbest = 1 + ask.alternatives
        find_terms = self._terms_finder(ask.glossary)
        if ask.split:  # documents: the characters counted as sent, markup and blanks included
            self.guards.check_characters(ask.lines)
            texts, applied = await translate_documents(
                self.admission, ask.lines, ask.format, nbest, ask.pair, self.translator.fits,
                find_terms,
            )  # fmt: skip
        else:
            applied, constraints = _sentence_terms(find_terms, ask.lines)
            translations = await self.admission.translate(ask.lines, nbest, ask.pair, constraints)
            texts = [[h.text for h in hypotheses] for hypotheses in translations]
        answer: dict[str, Any] = {"translatedText": [t[0] for t in texts]}
        if ask.alternatives:
            answer["alternatives"] = [t[1:] for t in texts]
        if ask.glossary is not None:
            answer["glossaryApplied"] = [
                [{"source": t.source, "target": t.target} for t in terms] for terms in applied
            ]
        if ask.single:
            answer = {key: value[0] for key, value in answer.items()}
        if ask.detected is not None:
            answer["detectedLanguage"] = {"language": ask.detected[0],
                                          "confidence": ask.detected[1]}  # fmt: skip
        return json_answer(answer)

    async def libre_translate_file(self, request: web.Request) -> web.Response:
        """LibreTranslate's ``/translate_file``: a multipart form's ``file`` translated into a
        file of the same format, kept for download; answered with its URL."""
        fields = await read_file_form(request)
        self.guards.admit(request, fields)
        ask = FileRequest.parse(fields, self.served)
        self.guards.check_characters([ask.text])
        translated = await translate_file(self.admission, ask, self.translator.fits)
        key = self.downloads.keep(ask.name, translated)
        path = f"/download_file/{key}/{urllib.parse.quote(ask.name)}"
        url = request.url.origin().with_path(path, encoded=True)
        return json_answer({"translatedFileUrl": str(url)})

    async def download_file(self, request: web.Request) -> web.Response:
        """A file ``/translate_file`` translated, while it is kept (the id is the key to it)."""
        name = request.match_info["name"]
        data = self.downloads.fetch(request.match_info["key"], name)
        if data is None:
            minutes = self.downloads.lifetime / 60
            raise Refused(404, f"no such file: translated files are kept {minutes:g} minutes")
        extension = "." + name.rpartition(".")[2].lower()
        return web.Response(body=data, headers={
            "Content-Type": FILE_TYPES[extension]
            + ("" if extension in BINARY else "; charset=utf-8"),
            "Content-Disposition": f'attachment; filename="{name}"',
        })  # fmt: skip

    def _terms_finder(
        self, glossary: list[tuple[str, str]] | str | None
    ) -> Callable[[str], list[Term]] | None:
        """What finds a sentence's terms of a request's ``glossary`` (its terms or the name of
        one loaded at the start); None without one."""
        if glossary is None:
            return None
        if isinstance(glossary, str):
            terms = self.glossaries[glossary]
        else:
            try:
                terms = self.translator.glossary(glossary)
            except ValueError as error:
                raise Refused(400, f"'glossary': {error}") from None
        return lambda text: terms.find(self.translator.pieces(text))

    async def translate_nbest(self, request: web.Request) -> web.Response:
        """``{"sentences": [...], "nbest": k, "alignment": bool}`` -> per sentence, in order,
        its k best hypotheses: text, pieces, base-2 score, positional scores (alignment)."""
        body = await read_body(request)
        self.guards.admit(request, body)
        ask = NbestRequest.parse(body, self.served)
        applied, constraints = _sentence_terms(self._terms_finder(ask.glossary), ask.sentences)
        translations = await self.admission.translate(
            ask.sentences, ask.nbest, ask.pair, constraints
        )
        answers = []
        for hypotheses, terms in zip(translations, applied, strict=True):
            answer: dict[str, Any] = {
                "hypotheses": [_hypothesis(h, ask.alignment) for h in hypotheses]
            }
            if ask.glossary is not None:
                answer["glossaryApplied"] = [{"source": t.source, "target": t.target}
                                             for t in terms]  # fmt: skip
            answers.append(answer)
        return json_answer({"translations": answers})

    async def detect(self, request: web.Request) -> web.Response:
        """LibreTranslate's ``/detect``: ``q`` a text -> the model's source languages the
        detector knows, most likely first, each with its confidence in percent."""
        body = await read_body(request)
        self.guards.admit(request, body)
        q = body.get("q")
        if not isinstance(q, str) or not q.strip():
            raise Refused(400, "'q' is required: a text")
        self.guards.check_characters([q])
        found = self.served.detector.detect(q)
        return json_answer([{"language": code, "confidence": p} for code, p in found])

    # ---- the rest ----------------------------------------------------------------------------

    async def libre_languages(self, request: web.Request) -> web.Response:
        languages = self.served.languages
        return json_answer([
            {"code": code, "name": language_name(code), "targets": languages.targets(code)}
            for code in languages.sources()
        ])  # fmt: skip

    async def health(self, request: web.Request) -> web.Response:
        translator = self.translator
        failure = translator.stream.failure
        status = (
            "failed" if failure
            else "restarting" if translator.restarting
            else "stopping" if self.admission.stopping
            else "ok"
        )  # fmt: skip
        answer = {"status": status, "queued": translator.queued, "in_flight": translator.in_flight}
        if failure:  # a load balancer takes it out; the log has the traceback
            answer["error"] = f"the decoder failed: {failure!r}"
        return json_answer(answer, status=200 if status == "ok" else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.guards.admit_metrics(request)
        response = web.Response(body=self.metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def openapi(self, request: web.Request) -> web.Response:
        return json_answer(self.spec)

    async def docs(self, request: web.Request) -> web.Response:
        return web.Response(text=DOCS.read_text(), content_type="text/html")

    async def page(self, request: web.Request) -> web.Response:
        settings = {
            "source": self.served.languages.default[0],
            "target": self.served.languages.default[1],
            "beam": self.translator.beam,
            "nbest": self.translator.nbest,
            "keys": self.guards.keys is not None,  # the page then asks for one
        }
        # "<" escaped so that no value can close the script element it is put in
        inline = json.dumps(settings).replace("<", "\\u003c")
        html = PAGE.read_text().replace("__SETTINGS__", inline)
        return web.Response(text=html, content_type="text/html")


def _sentence_terms(
    find_terms: Callable[[str], list[Term]] | None, sentences: list[str]
) -> tuple[list[list[Term]], list[Constraints | None] | None]:
    """The glossary's terms found in each of ``sentences`` and the constraints they make (a
    sentence without terms: None); no terms and no constraints without a glossary."""
    if find_terms is None:
        return [[] for _ in sentences], None
    applied = [find_terms(sentence) for sentence in sentences]
    return applied, [constraints_of(terms) or None for terms in applied]


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


async def serve(
    service: TranslationService, host: str, port: int, max_body_bytes: int, shutdown_timeout: float
) -> None:
    """Serve until SIGTERM or SIGINT, then stop listening and answer every accepted request."""
    runner = web.AppRunner(
        service.app(max_body_bytes),
        handle_signals=False,
        shutdown_timeout=shutdown_timeout,
        access_log=None,  # and no request is logged with its key
        handler_cancellation=True,  # a client that goes away cancels its request's sentences
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    address = runner.addresses[0]
    languages = service.served.languages
    if languages.multilingual:
        logger.info("%d language pairs; by default %s-%s", len(languages.pairs),
                    *languages.default)  # fmt: skip
    logger.info("serving %s-%s on http://%s:%d", *languages.default, *address[:2])
    await stop.wait()
    logger.info("stopping: no new requests; answering those accepted")
    service.admission.stopping = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        # A second signal (``timeout`` and process managers send one to the child and one to
        # its group) must not kill what is draining; the loop would restore the default.
        loop.remove_signal_handler(signum)
        signal.signal(signum, signal.SIG_IGN)
    await runner.cleanup()  # stops listening, then waits for the requests in progress

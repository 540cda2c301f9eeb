"""``beamplugin-serve``: a translation server on the continuous-batching engine.

Many clients, one engine: every sentence of every request goes into one TranslationStream, which
decodes them together with beam search in a process of its own (beamplugin.serving.decoder_process)
while the aiohttp event loop only parses, encodes and answers. Options are fairseq-interactive's
(parsed by fairseq's own parser, ``--user-dir`` and ``--task beam_translation`` implied) plus the
server's own (``--host``, ``--port``, ``--max-queued``, ...); each translation is what
fairseq-interactive prints for the line (its ``D-`` text, base-2 scores).

Endpoints: ``POST /translate`` (LibreTranslate's API), ``POST /v1/translate`` (n-best lists
with scores and alignments), ``GET /languages`` (LibreTranslate's), ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /spec`` (OpenAPI 3.1, beamplugin.serving.spec), ``GET
/docs`` (it, readable) and ``GET /`` (a page to try it). Bad input is answered with a
status and ``{"error": "..."}``: 400, 413 for a body over ``--max-body-bytes``, 415 for a body
neither JSON nor a form, 503 with Retry-After when the queue has no room. Guards
(beamplugin.serving.guards): 403 without a valid API key, 429 with Retry-After over a key's
requests per minute, 400 over the character limit. A client that goes away, or a request not
answered within ``--request-timeout`` (504), has its sentences cancelled. SIGTERM (or SIGINT)
stops taking requests, answers every accepted one, then exits 0.
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

from beamplugin.serving.decoder_process import DecoderRestarting
from beamplugin.serving.guards import Guards
from beamplugin.serving.metrics import ServerMetrics
from beamplugin.serving.responses import Refused, json_answer
from beamplugin.serving.spec import SpecSettings, openapi
from beamplugin.serving.translator import RefusedSentence, Translation, Translator
from beamplugin.streams import QueueFull, StreamClosed, StreamFailed

logger = logging.getLogger("beamplugin.serving.app")

PAGE = Path(__file__).with_name("page.html")
DOCS = Path(__file__).with_name("docs.html")
RETRY_AFTER_SECONDS = 1
TRANSLATION_ENDPOINTS = ("/translate", "/v1/translate")


class TranslationService:
    """The HTTP endpoints on one Translator, behind ``guards`` (none by default); a translation
    not answered within ``request_timeout`` seconds gets 504 and its sentences are cancelled."""

    def __init__(
        self,
        translator: Translator,
        max_request_sentences: int,
        guards: Guards | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.translator = translator
        self.max_request_sentences = max_request_sentences
        self.guards = guards or Guards()
        self.request_timeout = request_timeout
        self.metrics = ServerMetrics(translator)
        translator.observe(self.metrics)
        self.stopping = False
        self.languages = translator.source_lang, translator.target_lang
        self.spec = openapi(SpecSettings(
            *self.languages, translator.beam, translator.nbest, max_request_sentences,
            keys=self.guards.keys is not None, metrics_open=self.guards.metrics_open,
            char_limit=self.guards.char_limit, aligns=translator.aligns,
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
        if self.stopping:
            response.force_close()
        return response

    # ---- translation -------------------------------------------------------------------------

    async def _translate(self, lines: list[str], nbest: int) -> list[list[Translation]]:
        """The ``nbest`` best translations of each line, in order; Refused if the request
        cannot be taken (nothing of it is then queued) or is not answered in time (its
        sentences are then cancelled, as they are when the client goes away)."""
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        stopping = Refused(503, "the server is stopping", retry, reason="stopping")
        if self.stopping:
            raise stopping
        if not 1 <= len(lines) <= self.max_request_sentences:
            raise Refused(
                400, f"{len(lines)} sentences: a request has 1 to {self.max_request_sentences}"
            )
        self.guards.check_characters(lines)
        try:
            sources = self.translator.encode(lines)
        except RefusedSentence as refusal:
            raise Refused(400, str(refusal)) from None
        try:
            futures = self.translator.submit(sources)
        except QueueFull:
            raise Refused(
                503,
                f"the server is busy: no room for {len(lines)} more sentence(s), retry later",
                retry,
                reason="queue_full",
            ) from None
        except DecoderRestarting as restarting:
            raise Refused(503, f"{restarting}, retry later", retry, reason="restarting") from None
        except StreamFailed as failed:  # the model failed earlier: every request is told
            raise Refused(500, str(failed)) from None
        except StreamClosed:
            raise stopping from None
        try:
            async with asyncio.timeout(self.request_timeout):
                results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except TimeoutError:
            raise Refused(
                504,
                f"not translated within the request timeout of {self.request_timeout:g} s",
                reason="timeout",
            ) from None
        finally:  # whatever ended the wait early (timeout, client gone, a failed sentence)
            for future in futures:
                future.cancel()  # a sentence already answered stays answered
        translations = []
        for source, hypotheses in zip(sources, results, strict=True):
            rendered = self.translator.render(source, hypotheses[:nbest])
            translations.append(rendered)
            self.metrics.sentences.inc()
            self.metrics.source_tokens.inc(len(source))
            self.metrics.target_tokens.inc(rendered[0].tokens)
        return translations

    def _check_pair(self, body: dict[str, Any], required: bool) -> None:
        source, target = self.languages
        given = body.get("source"), body.get("target")
        if required and None in given:
            raise Refused(400, "'source' and 'target' are required (language codes)")
        if given[0] not in (None, source, "auto") or given[1] not in (None, target):
            raise Refused(
                400,
                f"this server translates {source} to {target}, not {given[0]} to {given[1]}",
            )

    async def libre_translate(self, request: web.Request) -> web.Response:
        """LibreTranslate's ``/translate``: ``q`` a string or a list of strings."""
        body = await _body(request)
        self.guards.admit(request, body)
        self._check_pair(body, required=True)
        q = body.get("q")
        if not (isinstance(q, str) or (isinstance(q, list) and all(isinstance(s, str) for s in q))):
            raise Refused(400, "'q' is required: a string or a list of strings")
        if body.get("format", "text") != "text":
            raise Refused(400, "only format 'text' is served")
        alternatives = _integer(body, "alternatives", 0, 0, self.translator.beam - 1)
        translations = await self._translate([q] if isinstance(q, str) else q, 1 + alternatives)
        texts = [[h.text for h in hypotheses] for hypotheses in translations]
        answer: dict[str, Any] = {"translatedText": [t[0] for t in texts]}
        if alternatives:
            answer["alternatives"] = [t[1:] for t in texts]
        if isinstance(q, str):
            answer = {key: value[0] for key, value in answer.items()}
        if body.get("source") == "auto":  # no detection: this server has one source language
            answer["detectedLanguage"] = {"language": self.languages[0], "confidence": 0.0}
        return json_answer(answer)

    async def translate_nbest(self, request: web.Request) -> web.Response:
        """``{"sentences": [...], "nbest": k, "alignment": bool}`` -> per sentence, in order,
        its k best hypotheses: text, pieces, base-2 score, positional scores (alignment)."""
        body = await _body(request)
        self.guards.admit(request, body)
        self._check_pair(body, required=False)
        sentences = body.get("sentences")
        if not (isinstance(sentences, list) and all(isinstance(s, str) for s in sentences)):
            raise Refused(400, "'sentences' is required: a list of strings")
        nbest = _integer(body, "nbest", self.translator.nbest, 1, self.translator.beam)
        alignment = body.get("alignment", False)
        if not isinstance(alignment, bool):
            raise Refused(400, "'alignment' must be true or false")
        if alignment and not self.translator.aligns:
            raise Refused(400, "alignments are served when the server runs with --print-alignment")
        translations = await self._translate(sentences, nbest)
        return json_answer(
            {
                "translations": [
                    {"hypotheses": [_hypothesis(h, alignment) for h in hypotheses]}
                    for hypotheses in translations
                ]
            }
        )

    # ---- the rest ----------------------------------------------------------------------------

    async def libre_languages(self, request: web.Request) -> web.Response:
        source, target = self.languages
        return json_answer([{"code": source, "name": source, "targets": [target]}])

    async def health(self, request: web.Request) -> web.Response:
        translator = self.translator
        failure = translator.stream.failure
        status = (
            "failed" if failure
            else "restarting" if translator.restarting
            else "stopping" if self.stopping
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
            "source": self.languages[0],
            "target": self.languages[1],
            "beam": self.translator.beam,
            "nbest": self.translator.nbest,
            "keys": self.guards.keys is not None,  # the page then asks for one
        }
        # "<" escaped so that no value can close the script element it is put in
        inline = json.dumps(settings).replace("<", "\\u003c")
        html = PAGE.read_text().replace("__SETTINGS__", inline)
        return web.Response(text=html, content_type="text/html")


async def _body(request: web.Request) -> dict[str, Any]:
    """A JSON object, or a URL-encoded form (LibreTranslate takes both), as a dict."""
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


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, str) and value.strip().isdigit():  # from a form
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"'{name}' must be an integer from {low} to {high}")
    return value


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
    logger.info("serving %s-%s on http://%s:%d", *service.languages, address[0], address[1])
    await stop.wait()
    logger.info("stopping: no new requests; answering those accepted")
    service.stopping = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        # A second signal (``timeout`` and process managers send one to the child and one to
        # its group) must not kill what is draining; the loop would restore the default.
        loop.remove_signal_handler(signum)
        signal.signal(signum, signal.SIG_IGN)
    await runner.cleanup()  # stops listening, then waits for the requests in progress

"""What every request goes through, around its endpoint's handler: any error answered as
``{"error": ...}`` with its status (a :class:`Refused`, aiohttp's own 404, 405, 413 ..., or an
exception of a failing model as 500), every request counted by endpoint and status, a
translation's time measured, and connections closed while the server stops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from beamplugin.serving.metrics import ServerMetrics
from beamplugin.serving.responses import Refused, json_answer

logger = logging.getLogger("beamplugin.serving.app")  # the server's log, as cli's
TRANSLATION_ENDPOINTS = ("/translate", "/v1/translate", "/translate_file")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def answering_errors(metrics: ServerMetrics, stopping: Callable[[], bool]) -> Middleware:
    """The middleware: every error as JSON; requests counted in ``metrics`` and translation
    requests timed; once ``stopping()``, no connection kept alive."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = request.match_info.route.resource
        path = endpoint.canonical if endpoint is not None else "other"
        try:
            response = await handler(request)
        except Refused as refused:
            if refused.reason is not None:
                metrics.rejected.labels(refused.reason).inc()
            response = json_answer(
                {"error": refused.message}, status=refused.status, headers=refused.headers
            )
        except asyncio.CancelledError:  # the client went away; its sentences are cancelled
            metrics.requests.labels(path, "499").inc()
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
        metrics.requests.labels(path, str(response.status)).inc()
        if path in TRANSLATION_ENDPOINTS:
            metrics.latency.labels(path).observe(time.perf_counter() - started)
        if stopping():
            response.force_close()
        return response

    return answer_errors

"""What every endpoint answers with: JSON bodies, and :class:`Refused` for a request turned away
with a status and ``{"error": message}``."""

from __future__ import annotations

import functools
import json
from typing import Any

from aiohttp import web


def json_answer(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """``data`` as a JSON response, non-ASCII text as UTF-8 rather than \\u escapes."""
    dumps = functools.partial(json.dumps, ensure_ascii=False)
    return web.json_response(data, status=status, headers=headers, dumps=dumps)


class Refused(Exception):
    """A request answered with ``status`` and ``{"error": message}``; ``reason`` names the guard
    that refused it in the metrics (None: the request itself was wrong)."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.reason = reason

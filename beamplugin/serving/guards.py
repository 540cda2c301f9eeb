"""Who may translate and how much: API keys (``--api-keys``), translation requests per minute per
key or, without keys, per client address (``--req-limit``, or a key's own limit), characters per
request (``--char-limit``). Each guard refuses with :class:`~beamplugin.serving.responses.Refused`.

Keys are kept only as SHA-256 digests and compared in constant time against every key (a wrong
key takes as long whichever key it resembles); a key is named in the limiter and in messages by
its line in the file, never by itself.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from beamplugin.serving.responses import Refused


@dataclass(frozen=True)
class ApiKey:
    line: int  # its line in the keys file: how it is named anywhere it must be named
    digest: bytes  # SHA-256 of the key
    per_minute: int | None  # its own request limit, else --req-limit's


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """The keys of ``path``: ``KEY`` or ``KEY<TAB>REQUESTS_PER_MINUTE`` a line; blank lines and
    lines starting with ``#`` are skipped. ValueError (naming the line, not the key) if a line
    is malformed or no key is there."""
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, limit = line.partition("\t")
        key, limit = key.strip(), limit.strip()
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"{path}, line {number}: a key is one word, then a tab and a limit")
        if limit and not (limit.isdigit() and int(limit) > 0):
            raise ValueError(f"{path}, line {number}: the requests per minute must be positive")
        keys.append(ApiKey(number, _digest(key), int(limit) if limit else None))
    if not keys:
        raise ValueError(f"{path} has no API key")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Guards:
    """The guards of one server. ``keys``: None serves anyone; ``req_limit``: translation
    requests per minute per key (or client address), None: unlimited; ``char_limit``:
    characters per request; ``metrics_open``: /metrics served without a key."""

    def __init__(
        self,
        keys: list[ApiKey] | None = None,
        req_limit: int | None = None,
        char_limit: int | None = None,
        metrics_open: bool = False,
    ) -> None:
        self.keys = keys
        self.req_limit = req_limit
        self.char_limit = char_limit
        self.metrics_open = metrics_open or keys is None
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._items: dict[int, RateLimitItem] = {}  # one per limit in use

    def admit(self, request: web.Request, body: dict[str, Any]) -> None:
        """Refuse a translation request without a valid key (403) or over its key's (or its
        address's) requests per minute (429 with Retry-After)."""
        key = self._key(request, body.get("api_key"))
        limit = key.per_minute if key and key.per_minute else self.req_limit
        if limit is None:
            return
        who = f"key {key.line}" if key else f"address {request.remote}"
        item = self._items.setdefault(limit, RateLimitItemPerMinute(limit))
        if not self._limiter.hit(item, who):
            reset = self._limiter.get_window_stats(item, who).reset_time
            retry_after = max(1, math.ceil(reset - time.time()))
            raise Refused(
                429,
                f"too many requests: at most {limit} a minute; retry in {retry_after} s",
                {"Retry-After": str(retry_after)},
                reason="rate_limit",
            )

    def admit_metrics(self, request: web.Request) -> None:
        """/metrics needs a key (as a bearer token) when keys are on, unless --metrics-open."""
        if not self.metrics_open:
            self._key(request, None)

    def check_characters(self, lines: list[str]) -> None:
        """400 if ``lines`` have more characters in all than --char-limit."""
        characters = sum(len(line) for line in lines)
        if self.char_limit is not None and characters > self.char_limit:
            raise Refused(
                400,
                f"{characters} characters: over the character limit of {self.char_limit} "
                "per request",
                reason="char_limit",
            )

    def _key(self, request: web.Request, in_body: Any) -> ApiKey | None:
        """The key the request gives (Authorization: Bearer, or api_key in its body), or None
        without keys; 403 if it gives none or an unknown one."""
        if self.keys is None:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else in_body
        if not isinstance(given, str) or not given:
            raise Refused(
                403,
                "an API key is required: 'api_key' in the body or 'Authorization: Bearer KEY'",
                reason="api_key",
            )
        digest = _digest(given)
        found = None
        for key in self.keys:  # every key compared, whichever matches
            if hmac.compare_digest(key.digest, digest) and found is None:
                found = key
        if found is None:
            raise Refused(403, "invalid API key", reason="api_key")
        return found

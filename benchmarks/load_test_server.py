"""Load test of a running beamplugin-serve: many concurrent clients, nothing lost, duplicated or
mismatched, and every kind of bad input answered with its status.

    python -m benchmarks.load_test_server --url http://127.0.0.1:8080 --sentences FILE \\
        --clients 32 --requests 200

1. Each distinct sentence of FILE (one a line) is translated alone, one request at a time: the
   reference.
2. ``--requests`` requests of 1 to 3 sentences drawn from FILE go out from ``--clients``
   concurrent clients, to ``/translate`` (LibreTranslate, ``q`` a string or a list) and to
   ``/v1/translate``; bad inputs go out among them. A 503 (queue full) is retried after its
   Retry-After. Every answer must hold exactly the reference translations of its sentences, in
   order (scores within 1e-4); every bad input its status and message.

Loopback only, bounded in count and time (``--time-limit``). Exit status 0 when all held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

SCORE_TOLERANCE = 1e-4


@dataclass
class BadInput:
    """A request the server must refuse with ``status`` and an error containing ``says``."""

    name: str
    path: str
    body: bytes
    status: int
    says: str
    content_type: str = "application/json"


def bad_inputs(sentence: str, body_limit: int, source: str, target: str) -> list[BadInput]:
    def as_json(value: object) -> bytes:
        return json.dumps(value).encode()

    pair = {"source": source, "target": target}
    return [
        BadInput("bad JSON", "/translate", b'{"q": "', 400, "not valid JSON"),
        BadInput("not UTF-8", "/translate", b'{"q": "\xff\xfe", "source": "x"}', 400, "UTF-8"),
        BadInput("no q", "/translate", as_json(pair), 400, "'q' is required"),
        BadInput("no sentences", "/v1/translate", as_json({}), 400, "'sentences' is required"),
        BadInput("not an object", "/v1/translate", as_json([sentence]), 400, "JSON object"),
        BadInput(
            "wrong language pair", "/translate",
            as_json({"q": sentence, "source": target, "target": source}), 400, "does not translate",
        ),  # fmt: skip
        BadInput(
            "line too long", "/v1/translate",
            as_json({"sentences": [" ".join([sentence] * 1000)]}), 400, "accepts at most",
        ),  # fmt: skip
        BadInput("empty text", "/translate", as_json({"q": "  ", **pair}), 400, "is empty"),
        BadInput(
            "nbest over beam", "/v1/translate", as_json({"sentences": [sentence], "nbest": 999}),
            400, "'nbest' must be",
        ),  # fmt: skip
        BadInput(
            "unknown format", "/translate", as_json({"q": sentence, "format": "pdf", **pair}),
            400, "format",
        ),  # fmt: skip
        BadInput("text body", "/translate", b"q", 415, "send JSON", "text/plain"),
        BadInput(
            "body too large", "/translate",
            as_json({"q": "a" * (body_limit + 1), **pair}), 413, "body size",
        ),  # fmt: skip
    ]


@dataclass
class Outcome:
    ok: int = 0
    retried_503: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, content_type: str = "application/json"
) -> tuple[int, dict, dict]:
    """Status, JSON answer and headers of one POST."""
    async with session.post(url, data=body, headers={"Content-Type": content_type}) as response:
        return response.status, await response.json(content_type=None), dict(response.headers)


async def translate_alone(session: aiohttp.ClientSession, base: str, sentence: str) -> dict:
    """The best hypothesis of ``sentence`` sent alone."""
    body = json.dumps({"sentences": [sentence], "nbest": 1}).encode()
    status, answer, _ = await post(session, base + "/v1/translate", body)
    if status != 200:
        raise RuntimeError(f"reference for {sentence!r}: {status} {answer}")
    return answer["translations"][0]["hypotheses"][0]


def check_answer(
    endpoint: str, sentences: list[str], single: bool, answer: dict, references: dict
) -> str | None:
    """Why ``answer`` is not the reference translations of ``sentences``; None if it is."""
    expected = [references[s] for s in sentences]
    if endpoint == "/translate":
        got = answer.get("translatedText")
        want = expected[0]["text"] if single else [e["text"] for e in expected]
        return None if got == want else f"/translate {sentences!r}: got {got!r}, want {want!r}"
    translations = answer.get("translations", [])
    if len(translations) != len(sentences):
        return f"{len(translations)} translations for {len(sentences)} sentences"
    for sentence, translation, reference in zip(sentences, translations, expected, strict=True):
        best = translation["hypotheses"][0]
        if best["text"] != reference["text"] or abs(best["score"] - reference["score"]) > (
            SCORE_TOLERANCE
        ):
            return f"/v1/translate {sentence!r}: got {best}, want {reference}"
    return None


async def one_request(
    session: aiohttp.ClientSession, base: str, sentences: list[str], endpoint: str,
    single: bool, references: dict, outcome: Outcome, deadline: float, pair: tuple[str, str],
) -> None:  # fmt: skip
    if endpoint == "/translate":
        q = sentences[0] if single else sentences
        body = {"q": q, "source": pair[0], "target": pair[1], "format": "text"}
    else:
        body = {"sentences": sentences}
    data = json.dumps(body).encode()
    while True:
        started = time.perf_counter()
        try:
            status, answer, headers = await post(session, base + endpoint, data)
        except (TimeoutError, aiohttp.ClientError) as error:
            outcome.failures.append(f"lost: {endpoint} {sentences!r}: {error!r}")
            return
        outcome.statuses[status] += 1
        if status == 503 and "Retry-After" in headers and time.monotonic() < deadline:
            outcome.retried_503 += 1
            await asyncio.sleep(float(headers["Retry-After"]))
            continue
        if status != 200:
            outcome.failures.append(f"{endpoint} {sentences!r}: {status} {answer}")
            return
        outcome.latencies.append(time.perf_counter() - started)
        problem = check_answer(endpoint, sentences, single, answer, references)
        if problem:
            outcome.failures.append(problem)
        else:
            outcome.ok += 1
        return


async def check_bad_input(
    session: aiohttp.ClientSession, base: str, bad: BadInput, outcome: Outcome
) -> None:
    status, answer, _ = await post(session, base + bad.path, bad.body, bad.content_type)
    if status != bad.status or bad.says not in str(answer.get("error")):
        outcome.failures.append(
            f"bad input '{bad.name}': got {status} {answer}, want {bad.status} saying {bad.says!r}"
        )


async def load_test(args: argparse.Namespace) -> Outcome:
    base = args.url.rstrip("/")
    if urlsplit(base).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load_test_server.py talks to a server on this machine only (loopback)")
    lines = [s.strip() for s in Path(args.sentences).read_text().splitlines() if s.strip()]
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.time_limit
    timeout = aiohttp.ClientTimeout(total=args.time_limit)
    connector = aiohttp.TCPConnector(limit=args.clients)
    outcome = Outcome()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(base + "/languages") as response:
            languages = await response.json()
        pair = languages[0]["code"], languages[0]["targets"][0]
        references = {}
        for sentence in dict.fromkeys(lines):
            references[sentence] = await translate_alone(session, base, sentence)
        jobs: list = []
        for _ in range(args.requests):
            sentences = rng.sample(lines, min(len(lines), rng.randint(1, 3)))
            endpoint = rng.choice(["/translate", "/v1/translate"])
            single = endpoint == "/translate" and len(sentences) == 1 and rng.random() < 0.5
            jobs.append(
                one_request(session, base, sentences, endpoint, single, references, outcome,
                            deadline, pair)  # fmt: skip
            )
        for bad in bad_inputs(lines[0], args.body_limit, *pair):
            jobs.insert(rng.randrange(len(jobs) + 1), check_bad_input(session, base, bad, outcome))
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)

        async def client() -> None:
            while not queue.empty():
                await queue.get_nowait()

        await asyncio.wait_for(
            asyncio.gather(*(client() for _ in range(args.clients))), args.time_limit
        )
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--sentences", required=True, help="source sentences, one a line")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--body-limit", type=int, default=1 << 20,
                        help="the server's --max-body-bytes")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=300, help="seconds, for everything")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    outcome = asyncio.run(load_test(args))
    elapsed = time.perf_counter() - started
    for failure in outcome.failures[:20]:
        print("FAIL", failure)
    statuses = " ".join(f"{s}:{n}" for s, n in sorted(outcome.statuses.items()))
    print(
        f"{args.requests} requests from {args.clients} clients in {elapsed:.1f} s: {outcome.ok} "
        f"answered correctly, {outcome.retried_503} retries after 503, "
        f"{len(outcome.failures)} failures (statuses {statuses})"
    )
    return 1 if outcome.failures or outcome.ok != args.requests else 0


if __name__ == "__main__":
    sys.exit(main())

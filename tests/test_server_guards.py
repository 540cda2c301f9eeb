"""beamplugin-serve's guards for real, on 127.0.0.1: API keys (403), requests per minute per key
(429 with Retry-After, other keys unaffected), the character limit (400), abandoned requests
cancelled (a client gone, a request timed out: 504), and the other clients' translations
unchanged throughout."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from fairseq_tools import BIN, REPO
from openapi_spec_validator import validate
from server_tools import (
    LINES,
    Server,
    check_against_spec,
    metric,
    model_options,
    shared_toy_model,
    status_and_json,
    talk_to_app,
)

# gamma: 3 requests a minute of its own, delta 1 (the spec test's 429)
KEYS = {"alpha": None, "beta": None, "gamma": 3, "delta": 1}
CHAR_LIMIT = 8000  # above the 256 sentences of the cancellation test


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def offline(toy) -> list[str]:
    """The best translation of each of LINES, each decoded alone in this process."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.translator import Translator

    _, cfg = parse_args(model_options(toy))
    translator = Translator(cfg, 8)
    try:
        texts = []
        pair = translator.languages.default
        for source in translator.encode(LINES, pair):
            [future] = translator.submit([source], pair)
            texts.append(translator.render(source, future.result(60), pair)[0].text)
    finally:
        translator.close()
    return texts


@pytest.fixture(scope="module")
def guarded(toy, tmp_path_factory):
    """Keys on, 50 requests a minute by default, one sentence in flight at a time (so that a
    large request takes a while), room for large requests."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# one key a line\n" + "".join(
        f"{key}\t{limit}\n" if limit else f"{key}\n" for key, limit in KEYS.items()
    ))  # fmt: skip
    server = Server(model_options(toy) + [
        "--api-keys", str(keys), "--req-limit", "50", "--char-limit", str(CHAR_LIMIT),
        "--batch-size", "1", "--max-queued", "512", "--max-request-sentences", "256",
    ])  # fmt: skip
    yield server
    assert server.stop() == 0


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def run(scenario, limit: float = 120):
    return asyncio.run(asyncio.wait_for(scenario, limit))


def test_api_keys_are_required_and_never_logged(guarded, offline):
    url = guarded.url

    async def scenario() -> dict:
        async with aiohttp.ClientSession() as session:
            v1 = url + "/v1/translate"
            libre = url + "/translate"
            one = {"sentences": [LINES[0]]}
            seen = {
                "none": await status_and_json(session.post(v1, json=one)),
                "wrong": await status_and_json(session.post(v1, json={**one, "api_key": "alph"})),
                "wrong bearer": await status_and_json(
                    session.post(v1, json=one, headers=bearer("alpha2"))
                ),
                "json": await status_and_json(session.post(v1, json={**one, "api_key": "alpha"})),
                "bearer": await status_and_json(session.post(v1, json=one, headers=bearer("beta"))),
                "form": await status_and_json(session.post(libre, data={
                    "q": LINES[1], "source": "de", "target": "en", "api_key": "beta",
                })),  # fmt: skip
                "health": await status_and_json(session.get(url + "/health")),
            }
            async with session.get(url + "/metrics") as response:
                seen["metrics without a key"] = response.status
            async with session.get(url + "/metrics", headers=bearer("alpha")) as response:
                seen["metrics"] = response.status, await response.text()
            return seen

    seen = run(scenario())
    for case in ("none", "wrong", "wrong bearer"):
        status, answer = seen[case]
        assert status == 403 and "key" in answer["error"], (case, seen[case])
    assert seen["none"][1]["error"].startswith("an API key is required")
    assert seen["wrong"][1] == {"error": "invalid API key"}
    for case in ("json", "bearer"):
        status, answer = seen[case]
        assert status == 200, (case, answer)
        assert answer["translations"][0]["hypotheses"][0]["text"] == offline[0]
    assert seen["form"] == (200, {"translatedText": offline[1]})
    assert seen["health"][0] == 200
    assert seen["metrics without a key"] == 403
    status, text = seen["metrics"]
    assert status == 200
    assert metric(text, 'beamplugin_requests_rejected_total{reason="api_key"}') >= 3
    log = "".join(guarded.log)
    assert f"{len(KEYS)} API keys" in log
    assert not any(key in log for key in [*KEYS, "alph"]), log


def test_a_key_over_its_request_limit_gets_429_and_other_keys_do_not(guarded, offline):
    url = guarded.url

    async def scenario() -> list:
        async with aiohttp.ClientSession() as session:
            async def libre(key: str) -> tuple[int, dict, str | None]:
                body = {"q": LINES[2], "source": "de", "target": "en", "api_key": key}
                async with session.post(url + "/translate", json=body) as response:
                    return (response.status, await response.json(),
                            response.headers.get("Retry-After"))  # fmt: skip

            return [await libre("gamma") for _ in range(4)] + [await libre("alpha")]

    *gamma, alpha = run(scenario())
    assert [status for status, _, _ in gamma] == [200, 200, 200, 429], gamma
    assert all(answer == {"translatedText": offline[2]} for _, answer, _ in gamma[:3])
    status, answer, retry_after = gamma[3]
    assert "at most 3 a minute" in answer["error"]
    assert retry_after is not None and 1 <= int(retry_after) <= 60
    assert alpha[:2] == (200, {"translatedText": offline[2]})


def test_a_request_over_the_character_limit_gets_400_naming_it(guarded):
    over = [LINES[3], "x" * (CHAR_LIMIT - len(LINES[3]) + 1)]
    status, answer = run(_post(guarded.url, {"sentences": over, "api_key": "alpha"}))
    assert status == 400, answer
    assert answer["error"] == (
        f"{CHAR_LIMIT + 1} characters: over the character limit of {CHAR_LIMIT} per request"
    )
    status, _ = run(_post(guarded.url, {"sentences": over[:1], "api_key": "alpha"}))
    assert status == 200


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        return await status_and_json(session.post(url + "/v1/translate", json=body))


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict | str]:
    async with session.get(url, headers=bearer("alpha")) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def test_a_client_gone_has_its_sentences_cancelled_in_the_decoder_process(guarded, offline):
    """256 sentences, one in flight at a time in the decoder process: the client goes away
    once they are decoding, and the server drops what is left within a second or two, while
    another client's request, sent meanwhile, gets its translations."""
    url = guarded.url
    big = {"sentences": (LINES * 11)[:256], "api_key": "beta"}

    async def scenario() -> tuple[float, dict, tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            _, before = await _get(session, url + "/metrics")
            abandoned = asyncio.create_task(_post(url, big))
            while True:
                status, health = await _get(session, url + "/health")
                if health["queued"] + health["in_flight"]:  # sent to the decoder process
                    break
                assert not abandoned.done(), abandoned.result()
                await asyncio.sleep(0.005)
            other = asyncio.create_task(_post(url, {"sentences": LINES[:6], "api_key": "beta"}))
            await asyncio.sleep(0.05)
            abandoned.cancel()  # its connection closes
            gone = time.monotonic()
            while True:
                status, health = await _get(session, url + "/health")
                if not health["queued"] + health["in_flight"]:
                    break
                assert time.monotonic() - gone < 30, health
                await asyncio.sleep(0.01)
            idle_after = time.monotonic() - gone
            answer = await other
            _, after = await _get(session, url + "/metrics")
            return idle_after, {"before": before, "after": after}, answer

    idle_after, metrics, other = run(scenario())
    status, answer = other
    assert status == 200
    assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == offline[:6]
    cancelled = metric(metrics["after"], "beamplugin_sentences_cancelled_total") - metric(
        metrics["before"], "beamplugin_sentences_cancelled_total"
    )
    # one at a time: a few were decoded before it went, the rest never were
    assert 200 <= cancelled <= 256, cancelled
    assert idle_after < 5, idle_after
    assert metric(metrics["after"], 'beamplugin_requests_total{endpoint="/v1/translate",'
                                    'status="499"}') >= 1  # fmt: skip


def slow_translator(toy: dict[str, Path], delay: float, gate: threading.Event | None = None):
    """A translator decoding in this process, two sentences at a time, whose every decoder
    step takes ``delay`` seconds more (and, with a ``gate``, waits while it is clear)."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.translator import Translator

    _, cfg = parse_args(model_options(toy) + ["--batch-size", "2"])
    translator = Translator(cfg, 64)
    model = translator.generator.model
    decode_step = model.decode_step

    def slow(*args, **kwargs):
        if gate is not None:
            gate.wait(30)
        time.sleep(delay)
        return decode_step(*args, **kwargs)

    model.decode_step = slow
    return translator


def test_a_client_gone_leaves_the_engine_within_a_few_steps(toy, offline):
    """Two clients; one goes away while its sentences are in flight and waiting: they are
    dropped, the engine goes on with the other's alone within two steps and is idle once that
    one is answered, with the same translations as offline."""
    gate = threading.Event()
    gate.set()
    translator = slow_translator(toy, 0.02, gate)
    engine = translator.stream.engine

    async def talk(session: aiohttp.ClientSession, url: str) -> tuple:
        gone_task = asyncio.create_task(_post(url, {"sentences": LINES[:8]}))
        while not engine.live:
            await asyncio.sleep(0.001)
        gate.clear()  # held, so that none of the first finishes before the second is queued
        stays = asyncio.create_task(_post(url, {"sentences": LINES[8:10]}))
        while translator.queued < 8:  # both requests accepted, two of the first in flight
            await asyncio.sleep(0.001)
        gone_task.cancel()  # its connection closes
        gate.set()
        steps = engine.steps
        while any(s.key.cancelled() for s in list(engine.live)) or translator.cancelled < 8:
            await asyncio.sleep(0.001)
        steps_to_leave = engine.steps - steps
        return steps_to_leave, await stays

    steps_to_leave, (status, answer) = talk_to_app(translator, talk)
    assert steps_to_leave <= 2, steps_to_leave
    assert status == 200
    assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == offline[8:10]
    assert translator.cancelled == 8 and translator.stream.engine.cancelled == 8
    assert engine.idle


def test_a_request_not_answered_in_time_gets_504_and_is_cancelled(toy):
    translator = slow_translator(toy, 0.1)  # 0.2 s: two steps, too few for any translation
    engine = translator.stream.engine

    async def talk(session: aiohttp.ClientSession, url: str) -> tuple:
        answer = await _answer(session.post(url + "/v1/translate",
                                            json={"sentences": LINES[:6]}))  # fmt: skip
        started = time.monotonic()
        while not engine.idle:
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.005)
        spec = await (await session.get(url + "/spec")).json()
        async with session.get(url + "/metrics") as response:
            return answer, spec, engine.steps, await response.text()

    answer, spec, steps, metrics = talk_to_app(translator, talk, request_timeout=0.2)
    status, _, body = answer
    assert status == 504 and "request timeout of 0.2 s" in body["error"], answer
    check_against_spec(spec, "post", "/v1/translate", answer)
    assert steps <= 4, steps  # the other four sentences never went in
    assert metric(metrics, "beamplugin_sentences_cancelled_total") == 6
    assert metric(metrics, 'beamplugin_requests_rejected_total{reason="timeout"}') == 1


async def _answer(request) -> tuple[int, str, object]:
    async with request as response:
        if response.content_type == "application/json":
            return response.status, response.content_type, await response.json()
        return response.status, response.content_type, await response.text()


def test_spec_is_valid_openapi_and_describes_every_answer(guarded):
    """/spec is valid OpenAPI 3.1, and the real answers of every endpoint, errors included,
    are ones it declares, with bodies of its schemas; /docs is a page of this server only."""
    url = guarded.url

    async def scenario() -> tuple[dict, list]:
        async with aiohttp.ClientSession() as session:
            spec = await (await session.get(url + "/spec")).json()
            key = {"api_key": "alpha"}
            libre = {"q": LINES[0], "source": "de", "target": "en", **key}
            v1 = url + "/v1/translate"
            answers = [
                ("post", "/translate", session.post(url + "/translate", json=libre)),
                ("post", "/translate", session.post(url + "/translate", json={
                    **libre, "q": LINES[:2], "alternatives": 1, "source": "auto"})),
                ("post", "/translate", session.post(url + "/translate", json={**libre, "q": 3})),
                ("post", "/v1/translate", session.post(v1, json={
                    "sentences": LINES[:2], "nbest": 2, "alignment": True, **key})),
                ("post", "/v1/translate", session.post(v1, json={"sentences": LINES[:1]})),
                ("post", "/v1/translate", session.post(v1, data="{", headers={
                    "Content-Type": "application/json", **bearer("alpha")})),
                ("post", "/v1/translate", session.post(v1, data="x", headers={
                    "Content-Type": "text/plain", **bearer("alpha")})),
                ("post", "/v1/translate", session.post(v1, json={"sentences": [LINES[0]],
                                                                 "api_key": "delta"})),
                ("post", "/v1/translate", session.post(v1, json={"sentences": [LINES[0]],
                                                                 "api_key": "delta"})),
                ("get", "/languages", session.get(url + "/languages")),
                ("post", "/detect", session.post(url + "/detect", json={"q": "Guten Tag!",
                                                                        **key})),
                ("post", "/detect", session.post(url + "/detect", json={"q": 3, **key})),
                ("post", "/translate_file", session.post(url + "/translate_file", data=_file(
                    "a.txt", LINES[0], key))),
                ("post", "/translate_file", session.post(url + "/translate_file", data=_file(
                    "a.pdf", LINES[0], key))),
                ("get", "/health", session.get(url + "/health")),
                ("get", "/metrics", session.get(url + "/metrics")),
                ("get", "/metrics", session.get(url + "/metrics", headers=bearer("beta"))),
                ("get", "/spec", session.get(url + "/spec")),
                ("get", "/docs", session.get(url + "/docs")),
                ("get", "/", session.get(url + "/")),
            ]  # fmt: skip
            answered = [(method, path, await _answer(r)) for method, path, r in answers]
            translated = answered[12][2][2]["translatedFileUrl"]
            for fetched in (translated, translated.rsplit("/", 1)[0] + "/b.txt"):
                answered.append(("get", "/download_file/{key}/{name}",
                                 await _answer(session.get(fetched))))  # fmt: skip
            return spec, answered

    spec, answers = run(scenario())
    validate(spec)
    statuses = [answer[0] for _, _, answer in answers]
    assert statuses == [200, 200, 400, 200, 403, 400, 415, 200, 429, 200, 200, 400, 200, 400,
                        200, 403, 200, 200, 200, 200, 200, 404], answers  # fmt: skip
    for method, path, answer in answers:
        check_against_spec(spec, method, path, answer)
    assert {path for _, path, _ in answers} == set(spec["paths"])
    docs = answers[-4][2][2]
    assert "/spec" in docs and not any(f'{a}="http' in docs for a in ("src", "href")), docs


def _file(name: str, text: str, fields: dict[str, str]) -> aiohttp.FormData:
    """A multipart form with ``text`` as the file ``name``, to translate from de to en."""
    form = aiohttp.FormData({"source": "de", "target": "en", **fields})
    form.add_field("file", text.encode(), filename=name)
    return form


def test_help_shows_the_server_and_decoding_options_first_and_help_all_the_rest():
    brief, full = (
        subprocess.run([str(BIN / "beamplugin-serve"), flag], capture_output=True, text=True,
                       timeout=120, cwd=REPO)  # fmt: skip
        for flag in ("--help", "--help-all")
    )
    assert brief.returncode == full.returncode == 0, brief.stderr + full.stderr
    lines = brief.stdout.splitlines()
    assert lines[0] == "usage: beamplugin-serve DATA-BIN --path CKPT.pt [options]"
    assert len(lines) < 80, brief.stdout
    for option in ("--path", "--beam", "--nbest", "--batch-size", "--bpe", "--port",
                   "--max-queued", "--request-timeout", "--api-keys", "--req-limit",
                   "--char-limit", "--metrics-open", "--help-all"):  # fmt: skip
        assert option in brief.stdout, option
    assert "--optimizer" not in brief.stdout and "--criterion" not in brief.stdout
    for option in ("--optimizer", "--criterion", "--api-keys", "--req-limit", "--beam"):
        assert option in full.stdout, option


def test_a_crashing_decoder_process_is_started_a_few_times_a_minute_at_most():
    from beamplugin.serving.decoder_process import Backoff

    backoff = Backoff()
    # each one dies as soon as it is up (or fails to start): the waits double, up to 30 s
    waits = [backoff.wait(lived=0.5), backoff.wait(lived=None)] + [
        backoff.wait(lived=2.0) for _ in range(6)
    ]
    assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
    starts, clock = 0, 0.0
    for wait in waits:  # starts within the first minute of deaths, starting itself free
        clock += wait
        starts += clock <= 60
    assert starts <= 5
    # one that lived a minute was fine: the next death waits 1 s again
    assert backoff.wait(lived=61.0) == 1
    assert backoff.wait(lived=1.0) == 2


def test_without_keys_the_request_limit_is_per_client_address(toy):
    """No keys: --req-limit counts each client address; /metrics stays open."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.guards import Guards
    from beamplugin.serving.translator import Translator

    _, cfg = parse_args(model_options(toy))
    translator = Translator(cfg, 8)

    async def talk(session: aiohttp.ClientSession, url: str) -> tuple:
        body = {"q": LINES[0], "source": "de", "target": "en"}
        answers = []
        for _ in range(3):
            async with session.post(url + "/translate", json=body) as response:
                answers.append((response.status, response.headers.get("Retry-After")))
        async with session.get(url + "/metrics") as response:
            return answers, response.status

    answers, metrics_status = talk_to_app(translator, talk, guards=Guards(req_limit=2))
    assert [status for status, _ in answers] == [200, 200, 429]
    assert 1 <= int(answers[2][1]) <= 60
    assert metrics_status == 200

"""beamplugin-serve for real: a server process on 127.0.0.1 with a small trained model and its
sentencepiece model, answering real HTTP from many concurrent clients. Every translation must be
what fairseq-interactive prints for the line with the same options; bad input gets its status; a
full queue answers 503; SIGTERM under load answers every accepted request and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from fairseq_tools import REPO, run_tool
from server_tools import (
    BODY_LIMIT,
    LINES,
    Server,
    chromium,
    metric,
    model_options,
    shared_toy_model,
    status_and_json,
    talk_to_app,
)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(toy):
    server = Server(model_options(toy) + ["--batch-size", "6", "--max-body-bytes",
                                          str(BODY_LIMIT)])  # fmt: skip
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def interactive(toy) -> dict[int, list[dict]]:
    """fairseq-interactive's hypotheses of LINES, by line: D text, score, P and A lines."""
    out = run_tool(
        "fairseq-interactive", "--user-dir", "beamplugin", "--task", "beam_translation",
        *model_options(toy), "--buffer-size", "8", "--batch-size", "8",
        stdin="\n".join(LINES) + "\n",
    ).stdout  # fmt: skip
    hypotheses: dict[int, list[dict]] = {}
    for line in out.splitlines():
        kind, _, rest = line.partition("\t")
        if not re.fullmatch(r"[DPA]-\d+", kind):
            continue
        index = int(kind[2:])
        if kind[0] == "D":
            score, text = rest.split("\t")
            hypotheses.setdefault(index, []).append({"text": text, "score": float(score)})
        elif kind[0] == "P":
            hypotheses[index][-1]["positional"] = [float(x) for x in rest.split()]
        else:
            hypotheses[index][-1]["alignment"] = rest
    assert sorted(hypotheses) == list(range(len(LINES)))
    return hypotheses


async def _post_all(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    """Every (path, JSON body) POSTed at once, each from a client (connection) of its own."""

    async def one(path: str, body: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=body) as response:
                return response.status, await response.json()

    return await asyncio.gather(*(one(path, body) for path, body in bodies))


def post_all(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    return asyncio.run(asyncio.wait_for(_post_all(url, bodies), 120))


def test_concurrent_clients_get_what_fairseq_interactive_prints(server, interactive):
    # one client per line, and requests of several lines, all at once
    bodies = [("/v1/translate", {"sentences": [line], "alignment": True}) for line in LINES]
    groups = [LINES[i : i + 5] for i in range(0, len(LINES), 5)]
    bodies += [("/v1/translate", {"sentences": g, "nbest": 1}) for g in groups]
    bodies += [("/translate", {"q": LINES[i], "source": "de", "target": "en"}) for i in (0, 3)]
    bodies += [("/translate", {"q": LINES[5:9], "source": "de", "target": "en",
                               "alternatives": 1})]  # fmt: skip
    answers = post_all(server.url, bodies)
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    for index, (_, answer) in enumerate(answers[: len(LINES)]):
        [translation] = answer["translations"]
        reference = interactive[index]
        assert len(translation["hypotheses"]) == len(reference) == 2  # --nbest 2
        for ours, theirs in zip(translation["hypotheses"], reference, strict=True):
            assert ours["text"] == theirs["text"]
            assert ours["score"] == pytest.approx(theirs["score"], abs=1e-4)
            assert [round(p, 4) for p in ours["positional_scores"]] == pytest.approx(
                theirs["positional"], abs=2e-4
            )
            assert ours["alignment"] == theirs["alignment"]
    offset = len(LINES)
    for g, group in enumerate(groups):
        translations = answers[offset + g][1]["translations"]
        first = LINES.index(group[0])
        assert [t["hypotheses"][0]["text"] for t in translations] == [
            interactive[first + i][0]["text"] for i in range(len(group))
        ]
        assert all(len(t["hypotheses"]) == 1 for t in translations)
    libre = [answer for _, answer in answers[offset + len(groups) :]]
    assert libre[0] == {"translatedText": interactive[0][0]["text"]}
    assert libre[1] == {"translatedText": interactive[3][0]["text"]}
    assert libre[2] == {
        "translatedText": [interactive[i][0]["text"] for i in range(5, 9)],
        "alternatives": [[interactive[i][1]["text"]] for i in range(5, 9)],
    }


def test_libretranslate_form_and_auto_source(server, interactive):
    async def scenario() -> tuple[int, dict, int, dict]:
        async with aiohttp.ClientSession() as session:
            form = {"q": LINES[2], "source": "auto", "target": "en", "format": "text"}
            async with session.post(server.url + "/translate", data=form) as response:
                answer = response.status, await response.json()
            async with session.get(server.url + "/languages") as response:
                return (*answer, response.status, await response.json())

    status, answer, languages_status, languages = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert status == 200 and answer["translatedText"] == interactive[2][0]["text"]
    # the one source language, with the detector's confidence (toy words are barely German)
    assert answer["detectedLanguage"]["language"] == "de"
    assert 0 <= answer["detectedLanguage"]["confidence"] <= 100
    assert (languages_status, languages) == (200, [{"code": "de", "name": "German",
                                                    "targets": ["en"]}])  # fmt: skip


def test_load_test_script_finds_nothing_lost_and_every_bad_input_refused(server, tmp_path):
    sentences = tmp_path / "sentences.de"
    sentences.write_text("\n".join(LINES[:12]) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.load_test_server", "--url", server.url,
         "--sentences", str(sentences), "--clients", "16", "--requests", "48",
         "--body-limit", str(BODY_LIMIT), "--time-limit", "120"],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "48 answered correctly" in result.stdout and "0 failures" in result.stdout


def test_health_metrics_and_refusals(server):
    async def scenario() -> dict:
        async with aiohttp.ClientSession() as session:
            async def get(path: str) -> tuple[int, str, str]:
                async with session.get(server.url + path) as response:
                    return response.status, response.content_type, await response.text()

            before = await get("/metrics")
            async with session.post(server.url + "/v1/translate",
                                    json={"sentences": LINES[:3]}) as response:  # fmt: skip
                assert response.status == 200
                await response.json()
            async with session.post(server.url + "/v1/translate",
                                    json={"sentences": [LINES[0]] * 65}) as response:  # fmt: skip
                too_many = response.status, await response.json()
            async with session.get(server.url + "/translate") as response:
                wrong_method = response.status, await response.json()
            return {"health": await get("/health"), "before": before,
                    "after": await get("/metrics"), "too_many": too_many,
                    "wrong_method": wrong_method, "missing": await get("/missing")}  # fmt: skip

    seen = asyncio.run(asyncio.wait_for(scenario(), 60))
    status, content_type, text = seen["health"]
    assert status == 200 and json.loads(text)["status"] == "ok"
    assert seen["too_many"] == (400, {"error": "65 sentences: a request has 1 to 64"})
    assert seen["wrong_method"][0] == 405 and "error" in seen["wrong_method"][1]
    assert seen["missing"][0] == 404
    assert seen["after"][1] == "text/plain"

    before, after = seen["before"][2], seen["after"][2]
    assert metric(after, "beamplugin_sentences_translated_total") - metric(
        before, "beamplugin_sentences_translated_total"
    ) == 3
    assert metric(after, "beamplugin_source_tokens_total") > metric(
        before, "beamplugin_source_tokens_total"
    )
    assert metric(after, "beamplugin_queue_depth") == 0
    assert metric(after, "beamplugin_sentences_in_flight") == 0
    v1 = 'beamplugin_request_latency_seconds_count{endpoint="/v1/translate"}'
    assert metric(after, v1) - metric(before, v1) == 2  # the 400 is timed too
    assert metric(after, 'beamplugin_requests_total{endpoint="/v1/translate",status="400"}') >= 1
    # the decoder's own figures, sent from its process: each of the 3 sentences waited once and
    # was in at least one step
    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("beamplugin_queue_wait_seconds_count") == 3
    assert grew("beamplugin_step_seconds_count") >= 3  # a translation takes a few steps
    assert grew("beamplugin_step_sentences_count") == grew("beamplugin_step_seconds_count")
    assert grew("beamplugin_step_sentences_sum") >= grew("beamplugin_step_sentences_count")
    assert grew("beamplugin_step_seconds_sum") > 0
    assert "beamplugin_sentences_cancelled_total 0.0" in after
    assert "beamplugin_decoder_restarts_total 0.0" in after


@pytest.fixture(scope="module")
def small_server(toy):
    """One sentence in flight, two waiting: easy to fill."""
    server = Server(model_options(toy) + ["--batch-size", "1", "--max-queued", "2"])
    yield server
    server.stop()


def test_a_full_queue_answers_503_with_retry_after(small_server, interactive):
    async def scenario() -> list[tuple[int, dict, str | None]]:
        async def one(line: str) -> tuple[int, dict, str | None]:
            async with aiohttp.ClientSession() as session:
                async with session.post(small_server.url + "/v1/translate",
                                        json={"sentences": [line]}) as response:  # fmt: skip
                    return (response.status, await response.json(),
                            response.headers.get("Retry-After"))  # fmt: skip

        return await asyncio.gather(*(one(line) for line in LINES[:16]))

    answers = asyncio.run(asyncio.wait_for(scenario(), 120))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) == {200, 503}, statuses
    for index, (status, answer, retry_after) in enumerate(answers):
        if status == 503:
            assert retry_after == "1" and "busy" in answer["error"]
        else:
            assert answer["translations"][0]["hypotheses"][0]["text"] == (
                interactive[index][0]["text"]
            )


def test_sigterm_under_load_answers_every_accepted_request(small_server, interactive):
    """Clients keep sending until the server is gone; SIGTERM comes while requests are in
    flight. Every request must be answered 200 (with its translation) or refused at admission
    (503, or no connection once the server stopped listening); the server exits 0 having
    translated exactly the sentences answered 200."""
    outcomes: list[tuple[float, str]] = []  # (time, what happened)
    sigterm_at: list[float] = []

    async def client(first: int) -> None:
        # a connection per request: a refused one is refused at connect (or reset unread)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            for step in range(200):
                index = (first + step) % len(LINES)
                try:
                    async with session.post(small_server.url + "/v1/translate",
                                            json={"sentences": [LINES[index]]}) as response:
                        status, answer = response.status, await response.json()  # fmt: skip
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                        aiohttp.ClientOSError):  # fmt: skip
                    outcomes.append((time.monotonic(), "not connected"))
                    return
                if status == 200:
                    text = answer["translations"][0]["hypotheses"][0]["text"]
                    assert text == interactive[index][0]["text"]
                    outcomes.append((time.monotonic(), "200"))
                else:
                    assert status == 503, (status, answer)
                    outcomes.append((time.monotonic(), "503"))
                    await asyncio.sleep(0.05)

    async def terminate_while_busy() -> None:
        while sum(1 for _, what in outcomes if what == "200") < 3:
            await asyncio.sleep(0.01)
        sigterm_at.append(time.monotonic())
        small_server.process.send_signal(signal.SIGTERM)

    async def scenario() -> float:
        async with aiohttp.ClientSession() as session:
            async with session.get(small_server.url + "/metrics") as response:
                earlier = metric(await response.text(), "beamplugin_sentences_translated_total")
        await asyncio.gather(terminate_while_busy(), *(client(k) for k in range(8)))
        return earlier

    earlier = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert small_server.process.wait(60) == 0
    log = "".join(small_server.log)
    answered = sum(1 for _, what in outcomes if what == "200")
    stopped = re.search(r"stopped: (\d+) sentences translated", log)
    assert stopped and int(stopped[1]) == earlier + answered, log[-2000:]
    # requests accepted before SIGTERM were still answered after it
    assert any(what == "200" and at > sigterm_at[0] for at, what in outcomes)
    assert sum(1 for _, what in outcomes if what == "not connected") == 8  # all saw it stop


def test_page_and_docs_in_a_real_browser(server, interactive, tmp_path):
    """Headless chromium: the pair's selectors show the one pair; a sentence typed and sent
    with Ctrl+Enter comes back beside its source with its n-best list and scores, and the time
    taken; a refused request shows its
    error inline; /docs shows every endpoint of /spec."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium(tmp_path)
    wait = WebDriverWait(browser, 60)
    try:
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "target").get_attribute("value"))
        assert browser.find_element(By.ID, "source").get_attribute("value") == "de"
        assert browser.find_element(By.ID, "target").get_attribute("value") == "en"
        nbest = browser.find_element(By.ID, "nbest")
        nbest.clear()
        nbest.send_keys("2")
        text = browser.find_element(By.ID, "text")
        text.send_keys(LINES[4] + Keys.ENTER + LINES[5])
        text.send_keys(Keys.CONTROL, Keys.ENTER)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "tr.sentence")) == 2)
        sentences = [
            (row.find_element(By.CSS_SELECTOR, "td.source").text,
             [(h.find_element(By.CSS_SELECTOR, "td.text").text,
               float(h.find_element(By.CSS_SELECTOR, "td.score").text))
              for h in row.find_elements(By.CSS_SELECTOR, "tr.hypothesis")])
            for row in browser.find_elements(By.CSS_SELECTOR, "tr.sentence")
        ]  # fmt: skip
        status = browser.find_element(By.ID, "status").text
        assert browser.find_element(By.ID, "error").text == ""

        nbest.clear()
        nbest.send_keys("9")  # over --beam 4
        text.send_keys(Keys.CONTROL, Keys.ENTER)
        wait.until(lambda b: b.find_element(By.ID, "error").text)
        error = browser.find_element(By.ID, "error").text
        rows_after_error = browser.find_elements(By.CSS_SELECTOR, "tr.sentence")

        browser.get(server.url + "/docs")
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "section.endpoint"))
        documented = {
            element.text for element in browser.find_elements(By.CSS_SELECTOR, "span.path")
        }
    finally:
        browser.quit()
    for index, (source, hypotheses) in zip((4, 5), sentences, strict=True):
        assert source == LINES[index]
        assert [text for text, _ in hypotheses] == [h["text"] for h in interactive[index]]
        assert [score for _, score in hypotheses] == pytest.approx(
            [h["score"] for h in interactive[index]], abs=2e-4  # shown with 4 decimals
        )
    assert re.fullmatch(r"2 sentence\(s\) in \d+ ms", status), status
    assert error == "400: 'nbest' must be an integer from 1 to 4"
    assert rows_after_error == []
    assert documented == {"/", "/docs", "/spec", "/health", "/metrics", "/languages",
                          "/translate", "/v1/translate", "/detect", "/translate_file",
                          "/download_file/{key}/{name}"}  # fmt: skip


def test_the_page_file_tab_uploads_a_file_and_offers_its_translation(server, tmp_path):
    """Headless chromium: on the page's file tab a .txt file chosen and sent comes back as a
    download link to the file /translate_file translated (its text as /translate translates
    it); a file of a format not translated shows the server's error inline."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    text = f"{LINES[6].capitalize()}. {LINES[7].capitalize()}!\n\n{LINES[8].capitalize()}.\n"
    notes, pdf = tmp_path / "notes.txt", tmp_path / "a.pdf"
    notes.write_text(text)
    pdf.write_bytes(b"%PDF-1.4")
    browser = chromium(tmp_path)
    wait = WebDriverWait(browser, 60)
    try:
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "target").get_attribute("value"))
        assert not browser.find_element(By.ID, "file").is_displayed()
        browser.find_element(By.ID, "tab-file").click()
        assert not browser.find_element(By.ID, "text").is_displayed()
        browser.find_element(By.ID, "file").send_keys(str(notes))
        browser.find_element(By.ID, "translate-file").click()
        wait.until(lambda b: b.find_element(By.ID, "download").is_displayed())
        url = browser.find_element(By.ID, "download").get_attribute("href")
        status = browser.find_element(By.ID, "status").text
        browser.find_element(By.ID, "file").send_keys(str(pdf))
        browser.find_element(By.ID, "translate-file").click()
        wait.until(lambda b: b.find_element(By.ID, "error").text)
        error = browser.find_element(By.ID, "error").text
        link_hidden = not browser.find_element(By.ID, "download").is_displayed()
    finally:
        browser.quit()

    async def download() -> bytes:
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                assert response.status == 200
                return await response.read()

    assert url.startswith(server.url + "/download_file/") and url.endswith("/notes.txt")
    [(code, answer)] = post_all(server.url, [("/translate", {"q": text, "source": "de",
                                                             "target": "en"})])  # fmt: skip
    assert code == 200
    assert asyncio.run(download()).decode() == answer["translatedText"]
    assert re.fullmatch(r"notes\.txt in \d+ ms", status), status
    assert error.startswith("400: 'file': .pdf is not translated")
    assert link_hidden


# the decoder thread ends with the model's error, as it should: its traceback is the log
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_model_answers_500_and_health_says_failed(toy):
    """The server's app on a real socket of 127.0.0.1, with a model that raises at its
    second decoder step: the request in progress gets 500 with the error, later requests 500 at
    once (nothing hangs), and /health answers 503 "failed"."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.translator import Translator

    args, cfg = parse_args(model_options(toy))
    translator = Translator(cfg, args.max_queued)
    model = translator.generator.model
    calls = []
    decode_step = model.decode_step

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the accelerator is gone")
        return decode_step(*a, **k)

    model.decode_step = failing

    async def talk(session: aiohttp.ClientSession, url: str) -> list[tuple[int, dict]]:
        translate = [
            await status_and_json(session.post(url + "/v1/translate",
                                               json={"sentences": LINES[:3]}))
            for _ in range(2)
        ]  # fmt: skip
        return [*translate, await status_and_json(session.get(url + "/health"))]

    during, after, health = talk_to_app(translator, talk)
    assert during == (500, {"error": "internal error: the accelerator is gone"})
    assert after[0] == 500 and "the decoder failed" in after[1]["error"], after
    assert health[0] == 503 and health[1]["status"] == "failed", health
    assert "the accelerator is gone" in health[1]["error"]


def test_a_killed_decoder_process_is_replaced(toy, interactive):
    """The server's app on a real socket of 127.0.0.1, decoding in its own process as
    beamplugin-serve does; that process is killed (as the out-of-memory killer would) while
    clients wait for their sentences: those requests get 500 naming the exit code, /health
    answers 503 "restarting" while another process starts, then 200; requests meanwhile get
    503 with Retry-After; afterwards every translation is right again, and the restart is
    counted."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.translator import Translator

    args, cfg = parse_args(model_options(toy) + ["--batch-size", "2"])
    translator = Translator(cfg, args.max_queued, in_process=False)
    stream = translator.stream
    first_pid = stream.pid

    async def talk(session: aiohttp.ClientSession, url: str) -> list:
        # Stopped first, so that it cannot answer any sentence before it is killed (a loaded
        # machine's HTTP is slower than the toy model).
        os.kill(first_pid, signal.SIGSTOP)
        during = [
            asyncio.create_task(status_and_json(session.post(
                url + "/v1/translate", json={"sentences": LINES[i : i + 4]}
            )))
            for i in range(0, 16, 4)
        ]  # fmt: skip
        while stream.queued + stream.in_flight < 16:  # all sent to the decoder process
            await asyncio.sleep(0.001)
        os.kill(first_pid, signal.SIGKILL)
        answers = await asyncio.gather(*during)
        health = await status_and_json(session.get(url + "/health"))
        async with session.post(url + "/v1/translate",
                                json={"sentences": LINES[:1]}) as response:  # fmt: skip
            meanwhile = response.status, await response.json(), response.headers["Retry-After"]
        deadline = time.monotonic() + 90
        while (await status_and_json(session.get(url + "/health")))[0] != 200:
            assert time.monotonic() < deadline, "no new decoder process in 90 s"
            await asyncio.sleep(0.2)
        after = await status_and_json(session.post(url + "/v1/translate",
                                                   json={"sentences": LINES[:8]}))  # fmt: skip
        async with session.get(url + "/metrics") as response:
            metrics = await response.text()
        return [answers, health, meanwhile, after, metrics]

    answers, health, meanwhile, after, metrics = talk_to_app(translator, talk)
    died = f"the decoder process ended (exit code -{signal.SIGKILL.value})"
    # the sentences of every request were still held; each failed with the exit code
    assert answers == [(500, {"error": f"internal error: {died}"})] * 4
    assert health[0] == 503 and health[1]["status"] == "restarting", health
    assert meanwhile[0] == 503 and "restarting" in meanwhile[1]["error"] and meanwhile[2] == "1"
    assert after[0] == 200, after
    assert [t["hypotheses"][0]["text"] for t in after[1]["translations"]] == [
        interactive[i][0]["text"] for i in range(8)
    ]
    assert stream.pid != first_pid
    assert metric(metrics, "beamplugin_decoder_restarts_total") == 1
    assert metric(metrics, 'beamplugin_requests_rejected_total{reason="restarting"}') == 1

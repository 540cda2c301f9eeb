"""Running beamplugin-serve, or its app, on 127.0.0.1 for tests, with the toy model of
fairseq_tools.sentencepiece_toy_model."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
from fairseq_tools import BIN, REPO, sentencepiece_toy_model, toy_sentence_pairs

LINES = [de for de, _ in toy_sentence_pairs(24, seed=7)]
BODY_LIMIT = 100_000


def shared_toy_model(tmp_path_factory: Any) -> dict[str, Path]:
    """The server tests' toy model, trained once for the whole run: in the directory all of
    pytest-xdist's workers share, under a lock, so that the server test modules on different
    workers do not train it twice."""
    run_temp = tmp_path_factory.getbasetemp()  # under xdist, a worker's: its parent is the run's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_temp = run_temp.parent
    shared = run_temp / "server-toy-model"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = shared / "done"
        if not done.exists():
            sentencepiece_toy_model(shared)
            done.touch()
    return {"data": shared / "bin", "checkpoint": shared / "ckpt" / "checkpoint_last.pt",
            "spm": shared / "spm.model"}  # fmt: skip


def model_options(toy: dict[str, Path]) -> list[str]:
    """What both fairseq-interactive and the server are given."""
    return [
        str(toy["data"]), "--path", str(toy["checkpoint"]), "--beam", "4", "--nbest", "2",
        "--bpe", "sentencepiece", "--sentencepiece-model", str(toy["spm"]),
        "-s", "de", "-t", "en", "--cpu", "--print-alignment",
    ]  # fmt: skip


class Server:
    """beamplugin-serve on a free port of 127.0.0.1, for at most ``lifetime`` seconds."""

    def __init__(self, options: list[str], lifetime: int = 300) -> None:
        command = ["timeout", "-k", "10", str(lifetime), str(BIN / "beamplugin-serve"),
                   *options, "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        self.log: list[str] = []
        self._started = threading.Event()
        self._url = ""

        def read_log() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                match = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", line)
                if match:
                    self._url = match[1]
                    self._started.set()
            self._started.set()

        threading.Thread(target=read_log, daemon=True).start()

    @property
    def url(self) -> str:
        """Once it serves (it loads while the caller does other work)."""
        self._started.wait(240)
        assert self._url, "the server did not start:\n" + "".join(self.log[-30:])
        return self._url

    def stop(self) -> int:
        """SIGTERM; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus' text format (0 if absent)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(match[1]) if match else 0.0


def talk_to_app(translator, talk, **service: Any) -> Any:
    """The server's app on ``translator`` (TranslationService's other arguments in
    ``service``), on a real socket of 127.0.0.1 in this process, as beamplugin-serve runs it:
    what ``talk(session, url)`` returns; the translator is closed afterwards."""
    from aiohttp import web

    from beamplugin.serving.app import TranslationService

    service = TranslationService(translator, max_request_sentences=64, **service)

    async def scenario() -> list[tuple[int, dict]]:
        runner = web.AppRunner(
            service.app(BODY_LIMIT), access_log=None, handler_cancellation=True
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await talk(session, f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    try:
        return asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        translator.close()


async def status_and_json(request) -> tuple[int, dict]:
    async with request as response:
        return response.status, await response.json()


def chromium(tmp_path: Path) -> Any:
    """Debian's headless chromium through its driver (a selenium WebDriver; quit it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    browser.set_page_load_timeout(60)
    return browser


def check_against_spec(spec: dict, method: str, path: str, answer: tuple) -> None:
    """``answer`` (status, content type, body: parsed JSON or text) is one the spec declares
    for ``method`` ``path``, with a body of its schema."""
    status, content_type, body = answer
    declared = spec["paths"][path][method]["responses"]
    assert str(status) in declared, (method, path, status, body)
    content = declared[str(status)]["content"]
    assert content_type in content, (method, path, status, content_type)
    # the schema with the spec's components beside it, so that its references resolve
    schema = {"allOf": [content[content_type]["schema"]], "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)

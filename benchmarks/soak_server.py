"""A soak of beamplugin-serve: tens of thousands of sentences from concurrent clients, some of
which go away mid-request; is memory flat, latency steady, and every answer right?

    python -m benchmarks.soak_server --path CKPT.pt --data DATA-BIN --spm SPM.model \\
        --sentences TEST.de [--total 20000 --clients 32 --abandon 0.05 --time-limit 1800]

The server runs on 127.0.0.1 as a subprocess (decoding in its own process, as deployed) and is
stopped with SIGTERM at the end. Each client sends requests of 1 to 4 random sentences back to
back; a fraction ``--abandon`` of the requests are given up (the connection closed) after a
random 1 to 50 ms. Every sentence answered is compared with the offline decoding of the same
sentence (in this process, the same generator, before the server starts). Reported: the
resident memory of the server's two processes after warm-up and at the end, latency
percentiles of each tenth of the run, sentences cancelled (the server's metric), and any
mismatch or error (exit status 1 then).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from benchmarks.server import ServerProcess


def model_options(args: argparse.Namespace) -> list[str]:
    return [
        str(args.data), "--path", str(args.path), "--beam", str(args.beam),
        "--bpe", "sentencepiece", "--sentencepiece-model", str(args.spm),
        "-s", args.source_lang, "-t", args.target_lang, "--cpu", "--max-len-b", str(args.max_len_b),
    ]  # fmt: skip


def offline(args: argparse.Namespace, sentences: list[str]) -> dict[str, str]:
    """The best translation of each sentence, decoded in this process as the server would."""
    from beamplugin.serving.cli import parse_args
    from beamplugin.serving.translator import Translator

    _, cfg = parse_args(model_options(args) + ["--batch-size", "64"])
    translator = Translator(cfg, len(sentences))
    try:
        pair = translator.languages.default
        sources = translator.encode(sentences, pair)
        futures = translator.submit(sources, pair)
        return {
            sentence: translator.render(source, future.result(), pair)[0].text
            for sentence, source, future in zip(sentences, sources, futures, strict=True)
        }
    finally:
        translator.close()


def rss(server: ServerProcess) -> dict[str, float]:
    """Resident memory (MiB) of the server and its decoder process."""
    serve, *others = psutil.Process(server.process.pid).children()
    decoders = [p for p in serve.children() if "resource_tracker" not in " ".join(
        p.cmdline())]  # fmt: skip
    return {
        "server": serve.memory_info().rss / 2**20,
        "decoder": sum(p.memory_info().rss for p in decoders) / 2**20,
    }


class Soak:
    """The clients' shared record."""

    def __init__(self, args: argparse.Namespace, reference: dict[str, str]) -> None:
        self.args = args
        self.reference = reference
        self.pool = list(reference)
        self.answered = 0  # sentences
        self.requests = 0
        self.abandoned = 0
        self.busy = 0  # 503s
        self.mismatches: list[tuple[str, str, str]] = []
        self.errors: list[str] = []
        self.latencies: list[tuple[float, float]] = []  # (when, seconds), answered requests
        self.started = time.monotonic()

    def done(self) -> bool:
        return (
            self.answered >= self.args.total
            or time.monotonic() - self.started > self.args.time_limit
            or len(self.errors) > 20
        )

    async def client(self, session: aiohttp.ClientSession, url: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self.done():
            sentences = rng.sample(self.pool, rng.randint(1, 4))
            post = self.post(session, url, sentences)
            if rng.random() < self.args.abandon:
                task = asyncio.create_task(post)
                await asyncio.sleep(rng.uniform(0.001, 0.05))
                if not task.done():
                    task.cancel()  # the connection is closed mid-request
                    self.abandoned += 1
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            else:
                await post

    async def post(self, session: aiohttp.ClientSession, url: str, sentences: list[str]) -> None:
        started = time.monotonic()
        self.requests += 1
        async with session.post(url + "/v1/translate", json={"sentences": sentences,
                                                             "nbest": 1}) as response:
            answer = await response.json()  # fmt: skip
        if response.status == 503:
            self.busy += 1
            await asyncio.sleep(0.05)
            return
        if response.status != 200:
            self.errors.append(f"{response.status}: {answer}")
            return
        self.latencies.append((started - self.started, time.monotonic() - started))
        for sentence, translation in zip(sentences, answer["translations"], strict=True):
            text = translation["hypotheses"][0]["text"]
            if text != self.reference[sentence]:
                self.mismatches.append((sentence, text, self.reference[sentence]))
        self.answered += len(sentences)


async def run_clients(soak: Soak, url: str, clients: int) -> None:
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(soak.client(session, url, seed) for seed in range(clients)))


async def scrape(url: str) -> tuple[dict, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as response:
            health = await response.json()
        async with session.get(url + "/metrics") as response:
            return health, await response.text()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(match[1]) if match else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="data directory (dictionaries)")
    parser.add_argument("--spm", required=True, help="sentencepiece model")
    parser.add_argument("--sentences", required=True, help="source sentences, one a line")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument(
        "--max-len-b", type=int, default=200,
        help="output tokens at most (fairseq's default 200): a weak model's few runaway "
        "sentences take that many steps, which shows in the latency's tail",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=64, help="the server's capacity")
    parser.add_argument("--total", type=int, default=20000, help="sentences to answer")
    parser.add_argument("--warmup", type=int, default=2000, help="sentences before the RSS")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--abandon", type=float, default=0.05, help="requests given up")
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds at most")
    args = parser.parse_args()

    lines = Path(args.sentences).read_text().splitlines()
    sentences = list(dict.fromkeys(line for line in lines if line.strip()))
    print(f"{len(sentences)} distinct sentences; decoding them offline for reference")
    reference = offline(args, sentences)
    server = ServerProcess(
        model_options(args) + ["--batch-size", str(args.batch_size)], threads=1,
        lifetime=args.time_limit + 900,
    )
    try:
        warmup = Soak(argparse.Namespace(**{**vars(args), "total": args.warmup,
                                            "abandon": 0.0}), reference)  # fmt: skip
        asyncio.run(run_clients(warmup, server.url, args.clients))
        rss_start = rss(server)
        soak = Soak(args, reference)
        asyncio.run(run_clients(soak, server.url, args.clients))
        time.sleep(1)  # the last cancellations leave the engine
        rss_end = rss(server)
        health, metrics = asyncio.run(scrape(server.url))
    finally:
        status = server.stop()
    elapsed = time.monotonic() - soak.started

    print(f"server: {' '.join(model_options(args))} --batch-size {args.batch_size}")
    print(f"{soak.answered} sentences answered in {soak.requests} requests from {args.clients} "
          f"clients in {elapsed:.0f} s ({soak.answered / elapsed:.0f} sentences/s), after "
          f"{warmup.answered} of warm-up")  # fmt: skip
    print(f"{soak.abandoned} requests abandoned mid-request; sentences cancelled by the server: "
          f"{metric(metrics, 'beamplugin_sentences_cancelled_total'):.0f}; 503s: {soak.busy}")
    print(f"at the end: {health}")
    for name in ("server", "decoder"):
        growth = 100 * (rss_end[name] / rss_start[name] - 1)
        print(f"RSS {name}: {rss_start[name]:.1f} MiB after warm-up, {rss_end[name]:.1f} MiB at "
              f"the end ({growth:+.1f}%)")  # fmt: skip
    print("latency of answered requests (ms), by tenth of the run:")
    print("  tenth  requests    p50    p90    p99    max")
    span = max(when for when, _ in soak.latencies) or 1.0
    tenths: list[list[float]] = [[] for _ in range(10)]
    for when, seconds in soak.latencies:
        tenths[min(9, int(10 * when / span))].append(1000 * seconds)
    for tenth, window in enumerate(tenths, 1):
        if window:
            print(f"  {tenth:>5} {len(window):>9} {statistics.median(window):>6.1f} "
                  f"{percentile(window, 0.9):>6.1f} {percentile(window, 0.99):>6.1f} "
                  f"{max(window):>6.1f}")  # fmt: skip
    print(f"mismatches with offline decoding: {len(soak.mismatches)}; errors: {len(soak.errors)}; "
          f"server exit status {status}")  # fmt: skip
    for sentence, got, expected in soak.mismatches[:5]:
        print(f"  {sentence!r}: {got!r}, offline {expected!r}")
    for error in soak.errors[:5]:
        print(f"  {error}")
    idle = health["queued"] == 0 and health["in_flight"] == 0
    return 0 if not soak.mismatches and not soak.errors and status == 0 and idle else 1


if __name__ == "__main__":
    sys.exit(main())

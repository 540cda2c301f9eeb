"""Throughput and latency of beamplugin-serve against offline decoding, measured side by side.

    python -m benchmarks.server --path CKPT.pt --data DATA-BIN --spm SPM.model \\
        --sentences TEST.de [--max-sentences 256 --clients 32 --rounds 3]

Systems, in interleaved rounds on the same sentences (beam 5 unless --beam), ratios per round
and their medians:
- offline: the engine at batch 64 as fairseq-generate drives it (the sentences in fairseq's
  length order, one stream of 64 in flight; the same generator as the server's), in this
  process, no HTTP;
- server: beamplugin-serve (capacity 64 sentences) with ``--clients`` concurrent clients each
  sending single-sentence requests back to back;
- one-at-a-time: the same server program with --batch-size 1 (what fairseq-interactive with
  --buffer-size 1 does), the same clients.
Each is given as sentences per second of wall clock and per CPU-second of the processes that
decode (the server's two, the HTTP side and its decoder, all their threads; this process's for
offline): on a CPU shared with other
work the wall clock mostly measures how much of it each process got. Then, on the server:
p50/p99 latency of single-sentence requests arriving as a Poisson process at
half its measured throughput, next to one request's latency alone (one client, one at a time).
The servers run on 127.0.0.1 as subprocesses and stop (SIGTERM) at the end, or after an hour.
Every server answer is checked against the offline translation of its sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import aiohttp
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from beamplugin.serving.translator import Translator
from beamplugin.streams import translate
from benchmarks import common
from benchmarks.common import cpu_description

BIN = Path(sys.executable).parent


def model_options(args: argparse.Namespace) -> list[str]:
    return [
        str(args.data), "--path", str(args.path), "--beam", str(args.beam),
        "--bpe", "sentencepiece", "--sentencepiece-model", str(args.spm),
        "-s", args.source_lang, "-t", args.target_lang, "--cpu",
    ]  # fmt: skip


class Timing(NamedTuple):
    wall: float  # seconds
    cpu: float  # CPU seconds of the processes that decoded
    texts: list[str]


class ServerProcess:
    """beamplugin-serve on a free port of 127.0.0.1, killed by ``timeout`` past ``lifetime``
    seconds."""

    def __init__(self, arguments: list[str], threads: int, lifetime: float = 3600) -> None:
        command = ["timeout", "-k", "10", str(int(lifetime)), str(BIN / "beamplugin-serve"),
                   *arguments, "--host", "127.0.0.1", "--port", "0",
                   "--max-queued", "1024"]  # fmt: skip
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        )  # fmt: skip
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stderr:
                match = re.search(r"serving \S+ on (http://\S+)", line)
                if match:
                    self.url = match[1]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(600)
        if not self.url:
            raise RuntimeError(f"beamplugin-serve {' '.join(arguments)} did not start")

    def cpu_seconds(self) -> float:
        """CPU time of the server (``timeout``'s child) and its decoder process, all their
        threads, so far."""
        return sum(cpu_seconds(pid) for pid in descendants(self.process.pid))

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, by them, and so on (not ``pid`` itself)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in map(int, children.read_text().split()):
            found += [child, *descendants(child)]
    return found


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def timed(run: Callable[[], tuple[float, list[str]]], cpu: Callable[[], float]) -> Timing:
    before = cpu()
    wall, texts = run()
    return Timing(wall, cpu() - before, texts)


async def _post(session: aiohttp.ClientSession, url: str, sentence: str) -> str:
    async with session.post(url + "/v1/translate", json={"sentences": [sentence]}) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {answer}")
        return answer["translations"][0]["hypotheses"][0]["text"]


async def closed_loop(url: str, sentences: list[str], clients: int) -> tuple[float, list[str]]:
    """Seconds for ``clients`` clients to translate ``sentences`` one request each, back to
    back; the translations in input order."""
    results: list[str] = [""] * len(sentences)
    pending = iter(range(len(sentences)))
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            for index in pending:
                results[index] = await _post(session, url, sentences[index])

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - started, results


async def open_loop(url: str, sentences: list[str], rate: float, seed: int) -> list[float]:
    """Latencies of single-sentence requests arriving as a Poisson process of ``rate``/s."""
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(sentence: str) -> None:
            started = time.perf_counter()
            await _post(session, url, sentence)
            latencies.append(time.perf_counter() - started)

        tasks = []
        for sentence in sentences:
            tasks.append(asyncio.create_task(one(sentence)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return latencies


async def one_at_a_time(url: str, sentences: list[str]) -> list[float]:
    latencies = []
    async with aiohttp.ClientSession() as session:
        for sentence in sentences:
            started = time.perf_counter()
            await _post(session, url, sentence)
            latencies.append(time.perf_counter() - started)
    return latencies


def offline(translator: Translator, sentences: list[str]) -> tuple[float, list[str]]:
    """Seconds to decode ``sentences`` at batch 64 in fairseq-generate's (length) order."""
    pair = translator.languages.default
    sources = translator.encode(sentences, pair)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[str] = [""] * len(sources)
    started = time.perf_counter()
    hypotheses = dict(translate(translator.generator, [sources[i] for i in order], 64))
    elapsed = time.perf_counter() - started
    for position, index in enumerate(order):
        results[index] = translator.render(sources[index], hypotheses[position][:1], pair)[0].text
    return elapsed, results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="binarized data (its dictionaries)")
    parser.add_argument("--spm", required=True, help="sentencepiece model")
    parser.add_argument("--sentences", required=True, help="raw source sentences, one a line")
    parser.add_argument("-s", "--source-lang", default="de")
    parser.add_argument("-t", "--target-lang", default="en")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--max-sentences", type=int, default=256)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of each process (OMP_NUM_THREADS); on a CPU shared with other "
        "work, 2 threads that wait for each other can be many times slower than 1",
    )  # fmt: skip
    parser.add_argument("--latency-sentences", type=int, default=64,
                        help="requests alone, one at a time")  # fmt: skip
    common.add_results_option(parser)
    args = parser.parse_args()
    lines = [s.strip() for s in Path(args.sentences).read_text().splitlines() if s.strip()]
    sentences = lines[: args.max_sentences]
    print(f"{len(sentences)} sentences of {args.sentences}, beam {args.beam}, "
          f"{args.clients} clients, {args.threads} thread(s) per process, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; {cpu_description()}", flush=True)  # fmt: skip
    torch.set_num_threads(args.threads)

    interactive = options.get_interactive_generation_parser(default_task="beam_translation")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        interactive, model_options(args) + ["--user-dir", str(Path(__file__).parents[1] /
                                                                "beamplugin")]))  # fmt: skip
    translator = Translator(cfg, max_queued=1)
    server = ServerProcess(model_options(args) + ["--batch-size", "64"], args.threads)
    single = ServerProcess(model_options(args) + ["--batch-size", "1"], args.threads)
    try:
        _, reference = offline(translator, sentences)  # warm-up
        asyncio.run(closed_loop(server.url, sentences[:64], args.clients))
        asyncio.run(closed_loop(single.url, sentences[:16], args.clients))
        n = len(sentences)
        rows = []
        mismatches = 0
        names = ("offline batch 64", "server", "one-at-a-time")
        for round_ in range(args.rounds):
            timings = [
                timed(lambda: offline(translator, sentences), time.process_time),
                timed(lambda: asyncio.run(closed_loop(server.url, sentences, args.clients)),
                      server.cpu_seconds),
                timed(lambda: asyncio.run(closed_loop(single.url, sentences, args.clients)),
                      single.cpu_seconds),
            ]  # fmt: skip
            for t in timings[1:]:
                mismatches += sum(a != b for a, b in zip(t.texts, reference, strict=True))
            rows.append([(n / t.wall, n / t.cpu) for t in timings])
            print(f"round {round_ + 1}: " + " | ".join(
                f"{name} {n / t.wall:.1f} sent/s, {n / t.cpu:.1f} per CPU-s"
                for name, t in zip(names, timings, strict=True)), flush=True)  # fmt: skip
        for k, unit in ((0, "sentences/s (wall clock)"), (1, "sentences per CPU-second")):
            median = [statistics.median(r[i][k] for r in rows) for i in range(3)]
            print(
                f"median {unit}: offline {median[0]:.1f}, server {median[1]:.1f}, one-at-a-time "
                f"{median[2]:.1f}; server/offline x"
                f"{statistics.median(r[1][k] / r[0][k] for r in rows):.2f}, server/one-at-a-time "
                f"x{statistics.median(r[1][k] / r[2][k] for r in rows):.2f}"
            )
        print(f"server translations differing from offline: {mismatches} of "
              f"{2 * args.rounds * n}")  # fmt: skip
        throughput = statistics.median(r[1][0] for r in rows)
        rate = throughput / 2
        loaded = asyncio.run(open_loop(server.url, sentences, rate, seed=0))
        alone = asyncio.run(one_at_a_time(server.url, sentences[: args.latency_sentences]))
        print(f"latency at half saturation ({rate:.1f} requests/s, Poisson): p50 "
              f"{1000 * percentile(loaded, 50):.0f} ms, p99 {1000 * percentile(loaded, 99):.0f} "
              f"ms; a request alone: p50 {1000 * percentile(alone, 50):.0f} ms, p99 "
              f"{1000 * percentile(alone, 99):.0f} ms")  # fmt: skip
        common.append_records(args.results, [
            common.record(
                table=common.table_name(), row="server", system=name,
                what=f"{args.path}: beamplugin-serve with {args.clients} clients sending single "
                     f"sentences ({n})", model=args.path, precision="float32", batch=64,
                sentences_per_s=statistics.median(r[index][0] for r in rows),
                sentences_per_cpu_s=statistics.median(r[index][1] for r in rows),
                ratio=None if name == "server" else {
                    "against": name, "value": statistics.median(r[1][0] / r[index][0]
                                                                for r in rows)},
                p99_ms_at_half_saturation=round(1000 * percentile(loaded, 99)),
                command=common.command_line(), **common.machine(threads=args.threads),
            )
            for index, name in enumerate(names)
        ])  # fmt: skip
    finally:
        codes = server.stop(), single.stop()
        translator.close()
    print(f"servers stopped with status {codes[0]} and {codes[1]}")


if __name__ == "__main__":
    main()

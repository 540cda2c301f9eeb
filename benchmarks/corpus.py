"""beamplugin-translate on a corpus: on one and on two Ray worker nodes, without Ray, and
fairseq-interactive with fairseq's own generator on the same model and lines.

    python -m benchmarks.corpus --path CKPT.pt --data DATA-BIN --spm SPM.model \\
        --corpus TRAIN.de --lines 6000 [--systems interactive local ray1 ray2 --rounds 1]

Systems, each a process (or a driver process and its Ray workers) run from the start, in
interleaved rounds; each round writes into a fresh directory:
- interactive: fairseq-interactive --task translation (fairseq's SequenceGenerator), lines on
  stdin, ``--buffer-size 1024 --batch-size 64`` (its best batching for a corpus), ``--threads``
  torch threads; interactive-1: the same with its default batching (one line at a time);
  interactive-ours: fairseq-interactive with our generator (task beam_translation), batched as
  interactive;
- local: beamplugin-translate without --ray (our stream), ``--threads`` torch threads;
- ray1 / ray2: beamplugin-translate --ray on a ray.cluster_utils.Cluster of this machine (a
  head without CPUs and one or two worker nodes of one CPU each, 127.0.0.1 only), one worker a
  node.
Each prints its wall clock (model loading and, on Ray, the workers' start included) and the
summary beamplugin-translate prints: per-worker throughput while busy and per CPU-second, peak
memory after the first and the last block (and after each block, from the manifest), the
driver's CPU a block against a block's decoding time. Every
system's translations are checked against the first one's (best hypotheses, beam ``--beam``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.common import cpu_description

BIN = Path(sys.executable).parent
# Ray's switch for this machine's loopback address as a node's address (docs/cluster.md).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# fairseq-interactive's task and batching by system: fairseq's generator with its best batching
# for a corpus, with its default (one line at a time), and ours inside fairseq-interactive.
INTERACTIVE = {
    "interactive": ["--task", "translation", "--buffer-size", "1024", "--batch-size", "64"],
    "interactive-1": ["--task", "translation"],
    "interactive-ours": ["--task", "beam_translation", "--buffer-size", "1024",
                         "--batch-size", "64"],
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="the checkpoint")
    parser.add_argument("--data", required=True, help="its data directory (dictionaries)")
    parser.add_argument("--spm", required=True, help="its sentencepiece model")
    parser.add_argument("--corpus", required=True, help="raw source text, one sentence a line")
    parser.add_argument("--lines", type=int, default=6000, help="its first N lines")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--block-lines", type=int, default=500)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of interactive and local (default: all cores)")
    parser.add_argument("--systems", nargs="+", default=["interactive", "local", "ray1", "ray2"],
                        choices=[*INTERACTIVE, "local", "ray1", "ray2"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    common.add_results_option(parser)
    return parser.parse_args()


def model_options(args: argparse.Namespace) -> list[str]:
    return [
        args.data, "--path", args.path, "--bpe", "sentencepiece", "--sentencepiece-model",
        args.spm, "-s", args.source_lang, "-t", args.target_lang, "--beam", str(args.beam),
    ]  # fmt: skip


def interactive(
    args: argparse.Namespace, system: str, corpus: Path
) -> tuple[list[str], str, float]:
    """fairseq-interactive's best translations (D- lines in input order), the end of its
    stderr and its wall clock."""
    started = time.perf_counter()
    with open(corpus, "rb") as stdin:
        done = subprocess.run(
            [str(BIN / "fairseq-interactive"), *model_options(args), "--user-dir",
             "beamplugin", *INTERACTIVE[system]],
            stdin=stdin, capture_output=True, check=True, env=threads_env(args),
        )  # fmt: skip
    seconds = time.perf_counter() - started
    out = done.stdout.decode("utf-8", "surrogateescape")
    best = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", out, flags=re.M))
    translations = [best.get(str(i), "") for i in range(args.lines)]
    return translations, done.stderr.decode()[-300:], seconds


def threads_env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


def corpus_job(
    args: argparse.Namespace, corpus: Path, work: Path, ray_address: str | None
) -> tuple[list[str], str, float]:
    """beamplugin-translate's translations, summary and wall clock."""
    command = [str(BIN / "beamplugin-translate"), *model_options(args), "--input", str(corpus),
               "--output", str(work), "--block-lines", str(args.block_lines)]  # fmt: skip
    env = threads_env(args)
    if ray_address is not None:
        command += ["--ray", ray_address]
        env = {**os.environ, **LOOPBACK}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 3):
        raise RuntimeError(f"beamplugin-translate failed:\n{done.stderr[-3000:]}")
    translations = (work / f"{corpus.name}.{args.target_lang}").read_text().split("\n")[:-1]
    return translations, done.stdout + memory_trend(work), seconds


def memory_trend(work: Path) -> str:
    """Each worker's peak memory after each of its blocks, as the manifest recorded it."""
    trend: dict[str, list[int]] = {}
    for line in (work / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "worker" in row:
            trend.setdefault(row["worker"], []).append(row["peak_rss_mib"])
    return "".join(
        f"\nworker {name}: peak RSS (MiB) after each block: {' '.join(map(str, mib))}"
        for name, mib in sorted(trend.items())
    )


def on_cluster(args: argparse.Namespace, corpus: Path, work: Path, nodes: int):
    """corpus_job on a Cluster of ``nodes`` worker nodes of one CPU, shut down afterwards."""
    os.environ.update(LOOPBACK)
    from ray.cluster_utils import Cluster

    node = {"object_store_memory": 200 * 2**20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, **node)
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, **node)
        return corpus_job(args, corpus, work, cluster.address)
    finally:
        cluster.shutdown()


def run_system(args: argparse.Namespace, system: str, corpus: Path, work: Path):
    if system in INTERACTIVE:
        return interactive(args, system, corpus)
    if system == "local":
        return corpus_job(args, corpus, work, None)
    return on_cluster(args, corpus, work, int(system[-1]))


def main() -> None:
    args = parse_args()
    print(cpu_description())
    print(f"{args.lines} lines of {args.corpus}, beam {args.beam}, blocks of {args.block_lines} "
          f"lines, {args.threads} torch thread(s) for interactive and local")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as temporary:
        root = Path(temporary)
        corpus = root / "corpus.txt"
        with open(args.corpus, "rb") as source:
            corpus.write_bytes(b"".join(itertools.islice(source, args.lines)))
        reference: list[str] | None = None
        for round_ in range(args.rounds):
            for system in args.systems:
                work = root / f"{system}-{round_}"
                translations, report, seconds = run_system(args, system, corpus, work)
                reference = reference or translations
                differ = sum(a != b for a, b in zip(translations, reference, strict=True))
                print(f"\n== round {round_ + 1}, {system}: {seconds:.1f} s, "
                      f"{args.lines / seconds:.1f} lines/s (its wall clock, loading included), "
                      f"{differ} translations differ from the first system's")  # fmt: skip
                print(report.strip())
                common.append_records(args.results, [common.record(
                    table=common.table_name(), row=f"corpus-{args.lines}",
                    what=f"{args.lines} lines of {args.corpus}, model loading included",
                    system=system, model=args.path, precision="float32",
                    sentences_per_s=args.lines / seconds,
                    same_as_first_system=f"{args.lines - differ}/{args.lines}",
                    command=common.command_line(), **common.machine(threads=args.threads),
                )])  # fmt: skip


if __name__ == "__main__":
    main()

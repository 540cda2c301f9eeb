"""benchmarks/generate.py, the speed benchmark against fairseq, runs both its parts at tiny
sizes: each system in a process of its own on a checkpoint, and fairseq's generator and ours in
one process on a random fconv; each prints its ratios and finds our best hypotheses equal to
fairseq's, and ``--results`` gets a record a system and batch size."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from beamplugin.fairseq_plugin.precision import native_on_cpu
from benchmarks.models import build

REPO = Path(__file__).resolve().parents[1]


def generate(*options: str, results: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.generate", "--threads", "1", "--repeats", "1",
         "--max-len-b", "6", *options, "--results", str(results)],
        capture_output=True, text=True, check=True, timeout=300, cwd=REPO,
    ).stdout  # fmt: skip


def test_in_one_process_on_a_random_fconv(tmp_path):
    results = tmp_path / "generate.jsonl"
    out = generate("--random", "--batch-sizes", "2", "--max-sentences", "2", results=results)
    rows = re.findall(r"^(fairseq|ours/fconv|ours/convs2s) .* speed-up x *([\d.]+)  outputs "
                      r"equal to fairseq: (\d+/\d+)$", out, re.M)  # fmt: skip
    assert [(name, same) for name, _, same in rows] == [
        ("fairseq", "2/2"), ("ours/fconv", "2/2"), ("ours/convs2s", "2/2")]
    assert "time split" in out and "per step" in out
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["system"], r["batch"], r["same_as_reference"]) for r in records] == [
        ("fairseq", 2, "2/2"), ("ours/fconv", 2, "2/2"), ("ours/convs2s", 2, "2/2")]
    assert {r["row"] for r in records} == {"random-fconv-in-process-b2"}
    assert all(r["command"].endswith("python -m benchmarks.generate --threads 1 --repeats 1 "
                                     "--max-len-b 6 --random --batch-sizes 2 --max-sentences 2")
               for r in records)  # fmt: skip


def test_each_system_in_a_process_of_its_own_on_a_checkpoint(tmp_path):
    checkpoint, data = build("base", "tiny", tmp_path)
    results = tmp_path / "generate.jsonl"
    out = generate("--path", str(checkpoint), "--data", str(data), "--batch-sizes", "2",
                   "--sentences", "2", "--systems", "ours", "ours bf16", "--label", "tiny",
                   results=results)  # fmt: skip
    rows = dict(re.findall(r"^(fairseq|ours) +[\d.]+ +[\d.]+ +[\d.]+ +(\d+/\d+) ", out, re.M))
    assert rows == {"fairseq": "2/2", "ours": "2/2"}
    records = [json.loads(line) for line in results.read_text().splitlines()]
    float32 = [r for r in records if r["system"] != "ours bf16"]
    assert sorted((r["system"], r["row"], r["same_as_reference"]) for r in float32) == [
        ("fairseq", "tiny-b2", "2/2"), ("ours", "tiny-b2", "2/2")]
    assert all(r["peak_mib"] > 0 and r["tokens_per_s"] > 0 for r in records)
    bf16 = [r for r in records if r["system"] == "ours bf16"]
    if native_on_cpu(torch.bfloat16):  # timed beside our float32, its ratio against it
        assert [(r["precision"], r["ratio"]["against"]) for r in bf16] == [("bf16", "ours")]
        assert re.search(r"^ +x[\d.]+ ours \(float32\)$", out, re.M)
    else:
        assert bf16 == [] and "ours bf16 left out" in out

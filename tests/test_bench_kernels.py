"""benchmarks/kernels.py, the first table of `make bench`, runs on this CPU: for the best
instruction set it runs, a row per shape and row count for our float32 products, and as many
for our int8 kernel against torch's int8 path where ours is built for the set; with ``paths``
each path of a float32 product, hot and cold; and with ``--results`` a record a row."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from beamplugin.kernels import instruction_sets

REPO = Path(__file__).resolve().parents[1]


def test_the_kernel_table_has_a_products_and_an_int8_row_for_each_shape(tmp_path):
    best = next(isa.name for isa in instruction_sets.SETS if instruction_sets.runs_here(isa))
    results = tmp_path / "kernels.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--sets", best, "--threads", "1",
         "--kernels", "products", "int8", "paths", "--shapes", "64x96", "--rounds", "1",
         "--calls", "2", "--results", str(results)],
        capture_output=True, text=True, check=True, timeout=300, cwd=REPO,
    ).stdout  # fmt: skip
    sets = dict(re.findall(r"^# (\w+): our kernels \w+, int8 (\w+);", out, re.M))
    assert list(sets) == [best]
    for name, int8 in sets.items():
        kernels = re.findall(rf"^(\w+)\s+64x96\s+\d+\s+{name}\s", out, re.M)
        assert kernels.count("products") > 0
        assert kernels.count("int8") == (0 if int8 == "none" else kernels.count("products"))
    paths = re.findall(rf"^\s+64x96\s+(\d+)\s+(hot|cold)\s+{best}(?:\s+[\d.]+){{5}}$", out, re.M)
    assert sorted(set(cache for _, cache in paths)) == ["cold", "hot"]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    printed = len(kernels) + len(paths)
    assert len(records) == printed
    assert {r["table"] for r in records} == {f"cpu-{best}"}
    command = (f"python -m benchmarks.kernels --sets {best} --threads 1 --kernels products int8 "
               "paths --shapes 64x96 --rounds 1 --calls 2")
    assert all(r["command"].endswith(command) for r in records)
    assert all(r["us_per_call"] > 0 and r["ratio"]["value"] > 0 for r in records)

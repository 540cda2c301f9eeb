"""The first engine of a process moves the objects alive then out of the garbage collector's
reach (beamplugin.runtime.collector): its full collections, which decoding triggers, then walk
what decoding made, not torch's, fairseq's and the model's objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_the_first_engine_freezes_what_is_alive_once_per_process():
    out = subprocess.run(
        [sys.executable, str(TESTS / "collector_probe.py")],
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    report = json.loads(out.stdout.splitlines()[-1])
    before, one, two = report["before"], report["after one"], report["after two"]
    assert before["frozen"] == 0 and before["model tracked"]
    # everything alive before the first decode, the model among it, is frozen by it
    assert one["frozen"] >= before["tracked"] and not one["model tracked"]
    assert two["frozen"] == one["frozen"]  # once per process
    # what a full collection walks while decoding: a small part of what was alive before
    assert two["tracked"] < before["tracked"] / 10
    assert two["same results"]

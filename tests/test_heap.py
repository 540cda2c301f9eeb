"""The decoding process keeps freed heap memory (beamplugin.runtime.heap): a stream decoded
again pays no page faults; with glibc's own thresholds it pays tens of thousands each time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from beamplugin.runtime.heap import keep_freed_memory

TESTS = Path(__file__).parent


def page_faults(**env: str) -> list[int]:
    """Minor page faults of heap_probe.py's passes after the first, in a fresh process."""
    out = subprocess.run(
        [sys.executable, str(TESTS / "heap_probe.py")],
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
        capture_output=True, text=True, check=True, timeout=120,
    )
    return [int(n) for n in out.stdout.split()[-5:]]


@pytest.mark.skipif(not keep_freed_memory(), reason="glibc only")
def test_a_stream_decoded_again_pays_no_page_faults():
    kept = page_faults()
    # a tunable of the user's, any: the engine leaves glibc's thresholds alone
    default = page_faults(GLIBC_TUNABLES="glibc.malloc.check=0")
    # the machine's own memory management adds a few hundred, now and then thousands: the
    # quietest pass counts
    assert min(kept) < 1000
    assert sum(default) > max(30_000, 50 * min(kept))

"""The decoding process keeps freed heap memory (beamplugin.runtime.heap): a stream decoded
again pays next to no page faults; with glibc's default mmap threshold held fixed it pays
hundreds of thousands each time. (glibc's own dynamic threshold lies in between and varies
from run to run, from a few thousand a pass to that, so it bounds nothing.)"""

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
    # a tunable of the user's: the engine leaves glibc's thresholds alone. This one is glibc's
    # default 128 KiB, set, which turns off its dynamic adjustment: every large block is mapped
    # and unmapped again, the same count each pass
    mapped = page_faults(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    # The machine's own memory management adds a few hundred faults to a pass, now and then
    # thousands, whatever the process does: not a count but the two compared, each by its
    # quietest pass. Mapping and unmapping every large block costs hundreds of thousands a pass.
    assert min(kept) * 100 < min(mapped), (kept, mapped)

"""beamplugin-translate for tests: a corpus of toy sentences with bad lines among them, the
command on the server tests' toy model, and what a job left in its output directory."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

from fairseq_tools import BIN, REPO, toy_sentence_pairs

# Lines (from 1) made bad in every corpus, and the reason each gets in the rejects file.
BAD_LINES = {
    3: (b"", "empty line"),
    10: (b" \t ", "empty line"),
    57: ("die katze \xe4".encode("latin-1"), "not valid UTF-8: 0xe4 at character 11"),
    130: (b"der hund " * 400, "too long: 2801 tokens"),
}


def write_corpus(directory: Path, lines: int, seed: int = 3) -> list[Path]:
    """``lines`` lines of toy German in two files, ``a.de`` (plain) and ``b.de.gz`` (gzip,
    without a final line end); BAD_LINES of the first file are bad."""
    text = [de.encode() for de, _ in toy_sentence_pairs(lines, seed)]
    for number, (line, _) in BAD_LINES.items():
        text[number - 1] = line
    half = lines // 2
    directory.mkdir(parents=True, exist_ok=True)
    plain, compressed = directory / "a.de", directory / "b.de.gz"
    plain.write_bytes(b"".join(line + b"\n" for line in text[:half]))
    compressed.write_bytes(gzip.compress(b"\n".join(text[half:])))
    return [plain, compressed]


def translate_command(toy: dict[str, Path], inputs: list[Path], output: Path, *extra: str):
    """beamplugin-translate on the toy model, beam 5."""
    return [
        str(BIN / "beamplugin-translate"), str(toy["data"]), "--path", str(toy["checkpoint"]),
        "--bpe", "sentencepiece", "--sentencepiece-model", str(toy["spm"]), "-s", "de",
        "-t", "en", "--beam", "5", "--input", *map(str, inputs), "--output", str(output),
        *extra,
    ]  # fmt: skip


def run(command: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip


def outputs(directory: Path) -> dict[str, bytes]:
    """The translations and rejects files of a job, by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.en*"))}


def block_rows(directory: Path) -> list[dict]:
    """The manifest's block rows (whole ones)."""
    manifest = directory / "manifest.jsonl"
    if not manifest.exists():
        return []
    rows = []
    for line in manifest.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n"):
            row = json.loads(line)
            if "first_line" in row:
                rows.append(row)
    return rows


def blocks_translated(summary: str) -> tuple[int, int, int]:
    """From a summary: blocks, those translated in that run, those done before it."""
    found = re.search(r"^blocks: (\d+), (\d+) translated now, (\d+) done before$", summary, re.M)
    assert found, summary
    return int(found[1]), int(found[2]), int(found[3])

"""The job's manifest, ``DIR/manifest.jsonl``: what is done, so that a job started again with
the same command does only the rest.

JSON lines, appended by the driver alone (the one writer), each flushed to disk:

- first, the job: ``{"job": {...}}``, the decoding options (those that change a translation),
  so that a rerun with other options cannot mix two kinds of output in one file;
- a block, after its part was written: ``{"input", "first_line", "lines", "sha256" (of the
  block's input bytes), "lines_out", "rejected": [[line number, reason], ...], "worker",
  "seconds", "peak_rss_mib", "terms_applied"}`` (the worker's peak memory so far: its trend over
  a job; the glossary's terms found in the block);
- an input whose output was assembled: ``{"assembled", "lines", "sha256"}`` (of the whole input).

A block is done when a row has its input, first line, line count and checksum (an input that
changed since is translated again). A row cut short by a killed driver is the file's last line:
it is dropped on opening, and its block done again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from beamplugin.corpus.inputs import Block, InputFile


class OtherJob(ValueError):
    """The output directory holds the manifest of a job with other decoding options."""


class Manifest:
    """The manifest at ``path``, of a job decoding with ``options`` (JSON-able)."""

    def __init__(self, path: Path, options: dict[str, Any]) -> None:
        self.path = path
        self._blocks: dict[tuple[str, int], dict] = {}
        self._assembled: dict[str, dict] = {}
        rows = self._read_whole_rows()
        job = {"job": json.loads(json.dumps(options, default=str))}
        if not rows:
            self._append(job)
        elif rows[0] != job:
            raise OtherJob(
                f"{path} is the manifest of a job with other decoding options; give another "
                "--output, or remove that directory to start again"
            )
        for row in rows[1:]:
            if "assembled" in row:
                self._assembled[row["assembled"]] = row
            else:
                self._blocks[row["input"], row["first_line"]] = row

    def _read_whole_rows(self) -> list[dict]:
        """The rows; a last row cut short is cut off the file, so that appends start whole."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            os.truncate(self.path, len(whole))
        return [json.loads(line) for line in whole.splitlines()]

    def _append(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
            stream.flush()
            os.fsync(stream.fileno())

    def done(self, source: InputFile, index: int) -> bool:
        """Whether block ``index`` of ``source``, as it is now, is done."""
        row = self._blocks.get((source.name, source.first_line(index)))
        expected = (source.block_size(index), source.block_sha256[index])
        return bool(row) and (row["lines"], row["sha256"]) == expected

    def record_block(self, block: Block, row: dict[str, Any]) -> None:
        """``block`` done: ``row`` holds what its translation reported."""
        full = {"input": block.input, "first_line": block.first_line, "lines": block.lines,
                "sha256": block.sha256, **row}  # fmt: skip
        self._append(full)
        self._blocks[block.input, block.first_line] = full

    def assembled(self, source: InputFile) -> bool:
        """Whether the output of ``source``, as it is now, was assembled."""
        row = self._assembled.get(source.name)
        return bool(row) and row["lines"] == source.lines and row["sha256"] == source.sha256

    def record_assembled(self, source: InputFile) -> None:
        row = {"assembled": source.name, "lines": source.lines, "sha256": source.sha256}
        self._append(row)
        self._assembled[source.name] = row

    def rejected(self, source: InputFile) -> list[tuple[str, int, str]]:
        """The rejected lines of ``source``'s blocks (input name, line number, reason), in
        order; every block done."""
        rows = []
        for index in range(len(source.block_sha256)):
            row = self._blocks[source.name, source.first_line(index)]
            rows.extend((source.name, line, reason) for line, reason in row["rejected"])
        return rows

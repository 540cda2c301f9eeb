"""What a job writes for one input file, each file once and whole: a temporary file, flushed
to disk, then renamed over its name (``os.replace``), so that a job stopped at any point leaves
either the old file or the new one, never half of one.

``DIR/<input name>.<target language>``: the translations, one line per input line, assembled
from the block parts ``DIR/.parts/<input name>.<target language>/<first line>`` once every block
is done (the parts are removed then); ``DIR/<input name>.<target language>.rejects.tsv``: the
lines not translated (input file, line number, reason), tab-separated.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

PARTS = ".parts"


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or what it held before."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as stream:
        stream.write(data)
        _flush(stream)
    os.replace(temporary, path)


def _flush(stream) -> None:
    """To the disk, not only to the kernel: a file the manifest vouches for must survive the
    machine's crash, not only the job's."""
    stream.flush()
    os.fsync(stream.fileno())


class OutputFiles:
    """The files of input ``input_name`` in ``directory``."""

    def __init__(self, directory: Path, input_name: str, target_lang: str) -> None:
        self.output = directory / f"{input_name}.{target_lang}"
        self.rejects = directory / f"{input_name}.{target_lang}.rejects.tsv"
        self.parts = directory / PARTS / self.output.name

    def part(self, first_line: int) -> Path:
        return self.parts / f"{first_line:012d}"

    def write_part(self, first_line: int, data: bytes) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)
        write_atomically(self.part(first_line), data)

    def assemble(self, first_lines: Iterable[int], rejects: Iterable[tuple[str, int, str]]) -> None:
        """The output from the parts of ``first_lines``, in that order, and the rejects file
        (rows: input file, line number, reason); then the parts go."""
        temporary = self.output.with_name(self.output.name + ".tmp")
        with open(temporary, "wb") as stream:
            for first_line in first_lines:
                with open(self.part(first_line), "rb") as part:
                    shutil.copyfileobj(part, stream)
            _flush(stream)
        os.replace(temporary, self.output)
        rows = "".join(f"{name}\t{line}\t{reason}\n" for name, line, reason in rejects)
        write_atomically(self.rejects, rows.encode())

    def remove_parts(self) -> None:
        shutil.rmtree(self.parts, ignore_errors=True)
        try:
            self.parts.parent.rmdir()  # once no input has parts left
        except OSError:
            pass

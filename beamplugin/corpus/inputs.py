"""The block plan: the corpus's input files (named, or matched by a glob), plain or gzip, cut
into blocks of consecutive lines; each file surveyed once first (its lines, its checksum and
each block's), then read again block by block as the blocks not done yet are handed out.

A line is what ends with ``\\n`` (a last line without it counts too), as fairseq-interactive
reads lines; its bytes are kept as read, so that a line that is not UTF-8 reaches the line
encoder, which refuses it alone.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, its lines, the SHA-256 of its (decompressed) bytes and of each
    of its blocks of ``block_lines`` lines (the last may have fewer)."""

    path: Path
    lines: int
    sha256: str
    block_lines: int
    block_sha256: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def first_line(self, index: int) -> int:
        """The number (from 1) of block ``index``'s first line."""
        return 1 + index * self.block_lines

    def block_size(self, index: int) -> int:
        """Block ``index``'s lines."""
        return min(self.block_lines, self.lines - index * self.block_lines)


@dataclass(frozen=True)
class Block:
    """Block ``index`` of input ``input``: lines ``first_line`` (from 1) to ``first_line +
    lines - 1``, ``data`` their bytes as read, line ends included, ``sha256`` its checksum."""

    input: str
    index: int
    first_line: int
    lines: int
    data: bytes
    sha256: str


def expand(patterns: list[str]) -> list[Path]:
    """The files of ``--input``: each a path, or else a glob (its matches in sorted order).
    Raises ValueError when one matches nothing or two have the same name (their outputs would
    be one file)."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
        if Path(pattern).is_file():  # a name with glob characters is itself first
            matches = [Path(pattern)]
        if not matches:
            raise ValueError(f"--input {pattern}: no such file")
        paths.extend(matches)
    names = [path.name for path in paths]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--input: several files named {', '.join(twice)} (one output each)")
    return paths


def open_input(path: Path) -> BinaryIO:
    """``path`` for reading its bytes: gzip when it starts as gzip does, whatever its name."""
    with open(path, "rb") as raw:
        compressed = raw.read(2) == GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def survey(path: Path, block_lines: int) -> InputFile:
    """``path``'s lines and checksums (its own and its blocks'), in one pass."""
    digest, block_digests = hashlib.sha256(), []
    with open_input(path) as stream:
        while raw := list(itertools.islice(stream, block_lines)):
            data = b"".join(raw)
            digest.update(data)
            block_digests.append((len(raw), hashlib.sha256(data).hexdigest()))
    lines = sum(count for count, _ in block_digests)
    sums = tuple(block_sum for _, block_sum in block_digests)
    return InputFile(path, lines, digest.hexdigest(), block_lines, sums)


def read_blocks(source: InputFile, wanted: list[int]) -> Iterator[Block]:
    """The blocks ``wanted`` (indexes, in increasing order) of ``source``, read as they are
    asked for. Raises RuntimeError when one is no longer what the survey found."""
    wanted_set = set(wanted)
    with open_input(source.path) as stream:
        for index in range(wanted[-1] + 1 if wanted else 0):
            raw = list(itertools.islice(stream, source.block_lines))
            if index not in wanted_set:
                continue
            data = b"".join(raw)
            checksum = hashlib.sha256(data).hexdigest()
            first_line = source.first_line(index)
            if checksum != source.block_sha256[index]:
                raise RuntimeError(f"{source.path}: lines from {first_line} changed during the job")
            yield Block(source.name, index, first_line, len(raw), data, checksum)


def split_lines(data: bytes) -> list[bytes]:
    """A block's lines, without their line ends."""
    return (data[:-1] if data.endswith(b"\n") else data).split(b"\n")

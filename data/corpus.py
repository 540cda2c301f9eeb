"""Read a parallel corpus, check it, and split it deterministically.

  corpus.py files SRC_FILE TGT_FILE OUT_PREFIX SRC TGT   two aligned files, one sentence a line
  corpus.py tsv FILE OUT_PREFIX SRC TGT                  one "source<TAB>target" pair a line
  corpus.py split PREFIX SRC TGT OUT_DIR VALID TEST SEED
      PREFIX.SRC/.TGT -> OUT_DIR/{train,valid,test}.SRC/.TGT

Bad input stops with a message naming the file and line: misaligned files, empty lines,
TSV lines without exactly two fields.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path

MAX_REPORTED = 5


class CorpusError(Exception):
    """The corpus cannot be used as given; the message says why and where."""


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    with path.open(encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


def _check_no_empty(lines: Sequence[str], name: str) -> None:
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if empty:
        shown = ", ".join(map(str, empty[:MAX_REPORTED]))
        shown += " ..." if len(empty) > MAX_REPORTED else ""
        raise CorpusError(f"{name}: {len(empty)} empty line(s), at line {shown}")


def read_files(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Two files that must hold the same number of non-empty lines."""
    src, tgt = _read_lines(src_path), _read_lines(tgt_path)
    if len(src) != len(tgt):
        raise CorpusError(
            f"misaligned corpus: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}"
        )
    if not src:
        raise CorpusError(f"{src_path} and {tgt_path} are empty")
    _check_no_empty(src, str(src_path))
    _check_no_empty(tgt, str(tgt_path))
    return src, tgt


def read_tsv(path: Path) -> tuple[list[str], list[str]]:
    """One pair a line, source and target separated by a single tab."""
    src, tgt = [], []
    for number, line in enumerate(_read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise CorpusError(
                f"{path}:{number}: expected 2 tab-separated fields, got {len(fields)}"
            )
        src.append(fields[0])
        tgt.append(fields[1])
    if not src:
        raise CorpusError(f"{path} is empty")
    _check_no_empty(src, f"{path} (source column)")
    _check_no_empty(tgt, f"{path} (target column)")
    return src, tgt


def _tidy(line: str) -> str:
    return " ".join(line.split())


def write_pairs(prefix: str, langs: Sequence[str], columns: Sequence[Sequence[str]]) -> None:
    for lang, column in zip(langs, columns, strict=True):
        Path(f"{prefix}.{lang}").write_text(
            "".join(_tidy(line) + "\n" for line in column), encoding="utf-8"
        )


def split(
    src: Sequence[str], valid_size: int, test_size: int, seed: int
) -> dict[str, list[int]]:
    """Line indices of train/valid/test, the same for the same corpus and seed.

    Pairs sharing a source sentence stay in one part, so no test source is seen in training.
    """
    groups: dict[str, list[int]] = {}
    for index, line in enumerate(src):
        groups.setdefault(line, []).append(index)
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    parts: dict[str, list[int]] = {"test": [], "valid": [], "train": []}
    wanted = {"test": test_size, "valid": valid_size}
    for group in order:
        part = next((p for p, n in wanted.items() if len(parts[p]) < n), "train")
        parts[part].extend(group)
    if len(parts["train"]) < valid_size + test_size:
        raise CorpusError(
            f"corpus of {len(src)} pairs is too small for {valid_size} valid and {test_size} "
            "test pairs; lower VALID_SIZE/TEST_SIZE"
        )
    return {part: sorted(indices) for part, indices in parts.items()}


def main(argv: list[str]) -> None:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "files" and len(args) == 5:
        src, tgt = read_files(Path(args[0]), Path(args[1]))
        write_pairs(args[2], args[3:5], (src, tgt))
        print(f"corpus: {len(src)} sentence pairs")
    elif command == "tsv" and len(args) == 4:
        src, tgt = read_tsv(Path(args[0]))
        write_pairs(args[1], args[2:4], (src, tgt))
        print(f"corpus: {len(src)} sentence pairs")
    elif command == "split" and len(args) == 7:
        prefix, langs, out_dir = args[0], args[1:3], Path(args[3])
        src, tgt = read_files(Path(f"{prefix}.{langs[0]}"), Path(f"{prefix}.{langs[1]}"))
        parts = split(src, int(args[4]), int(args[5]), int(args[6]))
        out_dir.mkdir(parents=True, exist_ok=True)
        for part, indices in parts.items():
            columns = ([src[i] for i in indices], [tgt[i] for i in indices])
            write_pairs(str(out_dir / part), langs, columns)
        print("split: " + ", ".join(f"{part} {len(ix)}" for part, ix in parts.items()))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except CorpusError as error:
        sys.exit(f"error: {error}")

"""Read a parallel corpus, refuse what cannot be one, clean it, and split it deterministically.

  corpus.py files SRC_FILE TGT_FILE OUT_PREFIX SRC TGT MAX_CHARS MAX_RATIO
      two aligned files, one sentence a line
  corpus.py tsv FILE OUT_PREFIX SRC TGT MAX_CHARS MAX_RATIO
      one "source<TAB>target" pair a line
  corpus.py split PREFIX SRC TGT OUT_DIR VALID TEST SEED
      PREFIX.SRC/.TGT -> OUT_DIR/{train,valid,test}.SRC/.TGT

Refused with a message naming the file and line: files of different lengths, TSV lines without
exactly two fields, bytes that are not UTF-8, an empty corpus. Cleaned as MT pipelines do (Moses'
clean-corpus-n; lengths here in characters, which every script has, not in words): a pair is
dropped when a side is empty, longer than MAX_CHARS characters, more than MAX_RATIO times
longer than the other side, or when it repeats an earlier pair exactly. The log says how many
pairs each rule dropped, with examples by line number.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

EXAMPLES = 3


class CorpusError(Exception):
    """The corpus cannot be used as given; the message says why and where."""


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 file without their line ends (\n or \r\n)."""
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    decoded = []
    for number, line in enumerate(lines, start=1):
        try:
            decoded.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as error:
            bad = " ".join(f"0x{b:02x}" for b in line[error.start : error.end])
            raise CorpusError(
                f"{path}:{number}: not valid UTF-8: {bad} at byte {error.start + 1} of the line"
            ) from None
    return decoded


def read_files(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Two files that must hold the same number of lines, line i of one translating line i."""
    src, tgt = _read_lines(src_path), _read_lines(tgt_path)
    if len(src) != len(tgt):
        raise CorpusError(
            f"misaligned corpus: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}"
        )
    if not src:
        raise CorpusError(f"{src_path} and {tgt_path} are empty")
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
    return src, tgt


@dataclass
class Rule:
    """One cleaning rule: what it drops, and the pairs it dropped (line number, why)."""

    description: str
    dropped: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Cleaned:
    src: list[str]
    tgt: list[str]
    read: int
    rules: list[Rule]

    def log(self) -> list[str]:
        """How many pairs each rule dropped, with the first EXAMPLES by line number."""
        lines = [f"cleaning: {self.read} pairs read, {len(self.src)} kept"]
        for rule in self.rules:
            examples = "; ".join(
                f"line {number}: {why}" for number, why in rule.dropped[:EXAMPLES]
            )
            more = " ..." if len(rule.dropped) > EXAMPLES else ""
            lines.append(
                f"  {len(rule.dropped):6d} dropped: {rule.description}"
                + (f" ({examples}{more})" if rule.dropped else "")
            )
        return lines


def clean(src: Sequence[str], tgt: Sequence[str], max_chars: int, max_ratio: float) -> Cleaned:
    """The pairs that pass every rule, in order; a pair counts for the first rule it breaks."""
    empty = Rule("a side is empty")
    too_long = Rule(f"a side is longer than {max_chars} characters")
    ratio = Rule(f"a side is more than {max_ratio:g} times longer than the other")
    repeated = Rule("repeats an earlier pair exactly")
    first_line: dict[tuple[str, str], int] = {}
    kept_src, kept_tgt = [], []
    for number, pair in enumerate(zip(map(_tidy, src), map(_tidy, tgt), strict=True), start=1):
        lengths = tuple(map(len, pair))
        if not all(lengths):
            sides = [side for side, n in zip(("source", "target"), lengths, strict=True) if not n]
            empty.dropped.append((number, "empty " + " and ".join(sides)))
        elif max(lengths) > max_chars:
            too_long.dropped.append((number, f"{lengths[0]} and {lengths[1]} characters"))
        elif max(lengths) > max_ratio * min(lengths):
            ratio.dropped.append((number, f"{lengths[0]} and {lengths[1]} characters"))
        elif pair in first_line:
            repeated.dropped.append((number, f"as line {first_line[pair]}"))
        else:
            first_line[pair] = number
            kept_src.append(pair[0])
            kept_tgt.append(pair[1])
    if not kept_src:
        raise CorpusError(f"no pair of the {len(src)} passed the cleaning rules")
    return Cleaned(kept_src, kept_tgt, len(src), [empty, too_long, ratio, repeated])


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
    if command in ("files", "tsv") and len(args) == (7 if command == "files" else 6):
        inputs, (prefix, src_lang, tgt_lang, max_chars, max_ratio) = args[:-5], args[-5:]
        read = read_files if command == "files" else read_tsv
        cleaned = clean(*read(*map(Path, inputs)), int(max_chars), float(max_ratio))
        write_pairs(prefix, (src_lang, tgt_lang), (cleaned.src, cleaned.tgt))
        log = "\n".join([f"corpus: {' '.join(inputs)}", *cleaned.log()]) + "\n"
        Path(f"{prefix}.cleaning.log").write_text(log, encoding="utf-8")
        print(log, end="")
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

"""Read fairseq-generate output: translations back in input order, and the speed it reports.

  gen_output.py collect OUT_FILE... HYP_FILE EXPECTED
      Writes the D- (detokenized) hypothesis of sentence 0 .. EXPECTED-1, one a line, to HYP_FILE,
      taking them from one output or from the shards of a --num-shards run; fails unless every
      sentence is there exactly once.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

_SPEED = re.compile(r"Translated ([\d,]+) sentences .*?\(([\d.]+) sentences/s")


class OutputError(Exception):
    """The generate output does not hold what it should; the message says what."""


def hypotheses(lines: Iterable[str]) -> dict[int, str]:
    """Sentence id -> best detokenized hypothesis (the first D- line of each id)."""
    found: dict[int, str] = {}
    for line in lines:
        if line.startswith("D-"):
            fields = line.rstrip("\n").split("\t")
            sentence_id = int(fields[0][2:])
            found.setdefault(sentence_id, fields[2] if len(fields) > 2 else "")
    return found


def merge(
    outputs: Iterable[Path], expected: int, allow_missing: bool = False
) -> list[str | None]:
    """Hypotheses of all outputs in input order: every id in 0..expected-1 exactly once.

    With allow_missing, an id nobody translated gives None instead of an error.
    """
    merged: dict[int, str] = {}
    for path in outputs:
        for sentence_id, text in hypotheses(path.read_text(encoding="utf-8").splitlines()).items():
            if sentence_id in merged:
                raise OutputError(f"sentence {sentence_id} translated twice (again in {path})")
            merged[sentence_id] = text
    missing = sorted(set(range(expected)) - merged.keys())
    extra = sorted(merged.keys() - set(range(expected)))
    if extra or (missing and not allow_missing):
        raise OutputError(
            f"{len(merged)} translations for {expected} sentences: "
            f"{len(missing)} missing (first ids {missing[:5]}), {len(extra)} unexpected ids"
        )
    return [merged.get(i) for i in range(expected)]


def speed(text: str) -> tuple[int, float]:
    """(sentences, sentences/s) from fairseq-generate's closing 'Translated ...' line."""
    match = _SPEED.search(text)
    if match is None:
        raise OutputError("no 'Translated N sentences ... sentences/s' line in the output")
    return int(match.group(1).replace(",", "")), float(match.group(2))


def main(argv: list[str]) -> None:
    if len(argv) >= 4 and argv[0] == "collect":
        *outputs, hyp_file, expected = argv[1:]
        translations = merge([Path(p) for p in outputs], int(expected))
        Path(hyp_file).write_text("".join(f"{t}\n" for t in translations), encoding="utf-8")
        print(f"collect: {len(translations)} translations in input order -> {hyp_file}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OutputError as error:
        sys.exit(f"error: {error}")

"""The demo's closing report, from what the pipeline left in the work directory.

  report.py WORK SRC TGT ARCH

Fails when our generator did not translate every test sentence exactly once.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_EPOCH = re.compile(r"\| train \| epoch (\d+) \|")


def _lines(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


def _minutes(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60:02d} s"


def report(work: Path, src: str, tgt: str, arch: str) -> list[str]:
    parts = {part: _lines(work / "split" / f"{part}.{src}") for part in ("train", "valid", "test")}
    ours = json.loads((work / "eval/ours/result.json").read_text())
    theirs = json.loads((work / "eval/fairseq/result.json").read_text())
    seconds = int((work / "checkpoints/train_seconds").read_text())
    epochs = _EPOCH.findall((work / "logs/train.log").read_text(encoding="utf-8"))
    ours_hyps = (work / f"eval/ours/hyps.{tgt}").read_text(encoding="utf-8").splitlines()
    their_hyps = (work / f"eval/fairseq/hyps.{tgt}").read_text(encoding="utf-8").splitlines()
    same = sum(a == b for a, b in zip(ours_hyps, their_hyps, strict=True))
    their_quality = (
        f"BLEU {theirs['bleu']}"
        if not theirs["missing"]
        else f"returned {theirs['sentences']} of {parts['test']} sentences, no BLEU"
    )
    if ours["sentences"] != parts["test"]:
        raise SystemExit(f"error: {ours['sentences']} translations for {parts['test']} sentences")
    lines = [
        f"corpus:        {sum(parts.values())} {src}-{tgt} sentence pairs: "
        + ", ".join(f"{part} {n}" for part, n in parts.items()),
        f"training:      {arch}, {int(epochs[-1]) if epochs else 0} epochs in {_minutes(seconds)}",
        f"test BLEU:     {ours['bleu']}  ({ours['bleu_line']})",
        f"               sacrebleu signature: {ours['signature']}",
        f"translations:  {ours['sentences']} hypotheses for {parts['test']} test sentences",
        f"our generator:      {ours['sentences_per_s']:8.1f} sentences/s"
        f"  (BLEU {ours['bleu']})",
        f"fairseq generator:  {theirs['sentences_per_s']:8.1f} sentences/s"
        f"  ({their_quality}), same checkpoint and test set",
        f"speed-up:      {ours['sentences_per_s'] / theirs['sentences_per_s']:.2f}x;"
        f" identical translations: {same} of {theirs['sentences']}",
    ]
    return lines


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        sys.exit(__doc__)
    print("\n".join(["", "==== beamplugin demo report ===="] + report(Path(argv[0]), *argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The demo's closing report, from what the pipeline left in the work directory; or, with
--compare, the models of several work directories side by side (the demo's ConvS2S and
configs/transformer.conf's transformer, say).

  report.py WORK SRC TGT ARCH TRAIN_MINUTES
  report.py --compare WORK [WORK...]

Fails when our generator did not translate every test sentence exactly once.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_UPDATES_PER_EPOCH = re.compile(r"grouped total_num_itrs = (\d+)")
_UPDATES = re.compile(r"\| (?:train|valid) \| epoch \d+ \|.*?\| num_updates (\d+)")
_STOPPED_BY_TIME = "Stopping training due to cumulative_training_time"
_EARLY_STOP = "early stop since valid performance hasn't improved"


def _lines(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


def _minutes(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60:02d} s"


def training_summary(train_log: str, seconds: int, budget_minutes: float) -> str:
    """How far training got (epochs, updates), in how much time, and why it stopped."""
    per_epoch = _UPDATES_PER_EPOCH.findall(train_log)
    updates = _UPDATES.findall(train_log)
    done = int(updates[-1]) if updates else 0
    epochs = f"{done / int(per_epoch[-1]):.1f} epochs" if per_epoch else "no epoch"
    used = f"{_minutes(seconds)} of training"
    if budget_minutes > 0:
        share = 100 * seconds / (60 * budget_minutes)
        used += f" ({share:.0f}% of the {budget_minutes:g}-minute budget)"
    if _STOPPED_BY_TIME in train_log:
        why = "stopped by the time budget"
    elif _EARLY_STOP in train_log:
        why = "stopped early: the valid loss stopped improving"
    else:
        why = "stopped at the recipe's epoch limit"
    return f"{epochs} ({done} updates) in {used}; {why}"


def report(work: Path, src: str, tgt: str, arch: str, budget_minutes: float) -> list[str]:
    parts = {part: _lines(work / "split" / f"{part}.{src}") for part in ("train", "valid", "test")}
    ours = json.loads((work / "eval/ours/result.json").read_text())
    theirs = json.loads((work / "eval/fairseq/result.json").read_text())
    seconds = int((work / "checkpoints/train_seconds").read_text())
    training = training_summary(
        (work / "logs/train.log").read_text(encoding="utf-8"), seconds, budget_minutes
    )
    cleaning = (work / "corpus/all.cleaning.log").read_text(encoding="utf-8").splitlines()[1]
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
        f"               {cleaning} (see {work / 'corpus/all.cleaning.log'})",
        f"training:      {arch}, {training}",
        f"test BLEU:     {ours['bleu']}  ({ours['bleu_line']})",
        f"               sacrebleu signature: {ours['signature']}",
        f"test chrF:     {ours['chrf']}  ({ours['chrf_line']})",
        f"               sacrebleu signature: {ours['chrf_signature']}",
        f"translations:  {ours['sentences']} hypotheses for {parts['test']} test sentences",
        f"our generator:      {ours['sentences_per_s']:8.1f} sentences/s"
        f"  (BLEU {ours['bleu']})",
        f"fairseq generator:  {theirs['sentences_per_s']:8.1f} sentences/s"
        f"  ({their_quality}), same checkpoint and test set",
        f"speed-up:      {ours['sentences_per_s'] / theirs['sentences_per_s']:.2f}x;"
        f" identical translations: {same} of {theirs['sentences']}",
    ]
    return lines


def comparison(works: list[Path]) -> list[str]:
    """One line per work directory: its model, test BLEU and chrF, our generator's and
    fairseq's sentences/s on the same checkpoint."""
    lines = [f"{'model':28s} {'BLEU':>6s} {'chrF':>6s} {'ours sent/s':>12s} "
             f"{'fairseq sent/s':>15s}  work directory"]
    for work in works:
        ours = json.loads((work / "eval/ours/result.json").read_text())
        theirs = json.loads((work / "eval/fairseq/result.json").read_text())
        claim = (work / "checkpoints/inputs.id").read_text().split()
        arch = next((word[5:] for word in claim if word.startswith("arch=")), "?")
        lines.append(
            f"{arch:28s} {ours['bleu']:6.2f} {ours['chrf']:6.2f} "
            f"{ours['sentences_per_s']:12.1f} {theirs['sentences_per_s']:15.1f}  {work}"
        )
    return lines


def main(argv: list[str]) -> None:
    if argv[:1] == ["--compare"] and len(argv) > 1:
        print("\n".join(comparison([Path(work) for work in argv[1:]])))
        return
    if len(argv) != 5:
        sys.exit(__doc__)
    lines = report(Path(argv[0]), *argv[1:4], budget_minutes=float(argv[4]))
    print("\n".join(["", "==== beamplugin demo report ===="] + lines))


if __name__ == "__main__":
    main(sys.argv[1:])

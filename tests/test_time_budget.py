"""The demo's training time budget (TRAIN_MINUTES): a whole run stops training in time and its
report says how far training got. A file of its own so that it runs beside test_pipeline.py's
demo (make test runs test files on two workers)."""

import re
import subprocess

from pipeline_tools import ROOT, env_for, toy_corpus

BUDGET = 6  # seconds: TRAIN_MINUTES 0.1


def test_a_time_budget_stops_training_in_time_and_the_report_says_how_far_it_got(tmp_path):
    """English to German on the toy corpus with 6 s of training (a budget of a few updates
    shows it as well as a longer one) and an epoch limit out of reach. There are no demo
    sentences in English: the interactive step types test sources."""
    de, en = toy_corpus(tmp_path)
    work = tmp_path / "work"
    result = subprocess.run(
        ["bash", str(ROOT / "data" / "run_demo.sh"), "--files", str(en), str(de)],
        env=env_for(work, SRC="en", TGT="de", TRAIN_MINUTES="0.1", MAX_EPOCH="100000"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    train_log = (work / "logs" / "train.log").read_text()
    # fairseq checks its training time (data loading included) after every update and stops
    # at the first one past the budget: over it by less than an update (on a busy machine one
    # update of this tiny model has taken 15 s; on a free one it takes a fraction of a second).
    hours = re.search(r"cumulative_training_time: ([\d.]+) > stop_time_hours: 0.001666", train_log)
    assert hours, train_log[-3000:]
    stopped_at = float(hours.group(1)) * 3600
    updates = int(re.findall(r"\| num_updates (\d+)", train_log)[-1])
    per_epoch = int(re.search(r"grouped total_num_itrs = (\d+)", train_log).group(1))
    train_wall = int(re.findall(r"\| train \| .*\| train_wall (\d+)", train_log)[-1])
    assert 1 <= updates < per_epoch * 100000
    assert BUDGET < stopped_at < BUDGET + 5 + 2 * train_wall / updates
    # The step's own clock adds fairseq-train's start-up (seconds; 80 on the busy machine),
    # the last validation and checkpoint.
    seconds = int((work / "checkpoints" / "train_seconds").read_text())
    assert stopped_at < seconds < stopped_at + 150
    assert (
        f"training:      convs2s_tiny, {updates / per_epoch:.1f} epochs ({updates} updates) in "
        f"{seconds // 60} min {seconds % 60:02d} s of training ({100 * seconds / BUDGET:.0f}% of "
        "the 0.1-minute budget); stopped by the time budget"
    ) in result.stdout.splitlines()
    assert re.search(r"^test chrF:\s+[\d.]+  \(chrF2 = [\d.]+\)$", result.stdout, re.MULTILINE)
    assert "cleaning: 1200 pairs read, 1200 kept" in result.stdout
    sources = (work / "split" / "test.en").read_text().splitlines()[:3]
    shown = re.findall(r"^(.*)\n  -> (\S.*)$", result.stdout, re.MULTILINE)
    assert [source for source, _ in shown] == sources

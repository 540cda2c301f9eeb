"""The data pipeline end to end (data/run_demo.sh) on a small corpus this test writes.

A tiny ConvS2S (configs/smoke.conf) learns a word-for-word German-English toy language, so a
working pipeline must reach a high BLEU; the run is interrupted once during training and must
resume. Also: bad corpora stop with a clear message, finished steps are skipped, and sharded
generation puts translations back in input order.
"""

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
LEXICON = {
    "adjective": {"rote": "red", "blaue": "blue", "grüne": "green", "kleine": "small",
                  "große": "big", "alte": "old", "junge": "young", "schnelle": "fast"},
    "noun": {"Hund": "dog", "Mann": "man", "Vogel": "bird", "Baum": "tree", "Tisch": "table",
             "Zug": "train", "Fisch": "fish", "Lehrer": "teacher"},
    "verb": {"schläft": "sleeps", "wartet": "waits", "steht": "stands", "fällt": "falls",
             "lacht": "laughs", "singt": "sings"},
    "adverb": {"hier": "here", "dort": "there", "heute": "today", "morgen": "tomorrow",
               "oft": "often", "nie": "never"},
}
PAIRS = 1200
TEST_SIZE = 40


def toy_corpus(directory: Path) -> tuple[Path, Path]:
    """PAIRS distinct 'Der rote Hund schläft hier.' / 'The red dog sleeps here.' pairs."""
    words = [list(LEXICON[kind].items()) for kind in ("adjective", "noun", "verb", "adverb")]
    combos = [(a, n, v, d) for a in words[0] for n in words[1] for v in words[2] for d in words[3]]
    random.Random(0).shuffle(combos)
    de = [f"Der {a[0]} {n[0]} {v[0]} {d[0]}." for a, n, v, d in combos[:PAIRS]]
    en = [f"The {a[1]} {n[1]} {v[1]} {d[1]}." for a, n, v, d in combos[:PAIRS]]
    (directory / "toy.de").write_text("\n".join(de) + "\n")
    (directory / "toy.en").write_text("\n".join(en) + "\n")
    return directory / "toy.de", directory / "toy.en"


def env_for(work: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        **extra,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "CONFIG": str(ROOT / "configs" / "smoke.conf"),
        "WORK": str(work),
        "TEST_SIZE": str(TEST_SIZE),
    }


def run(script: str, *args: object, work: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "data" / script), *map(str, args)],
        env=env_for(work, **env), capture_output=True, text=True, timeout=600,
    )


def test_misaligned_and_empty_corpora_stop_with_a_clear_message(tmp_path):
    de, en = toy_corpus(tmp_path)
    short = tmp_path / "short.en"
    short.write_text("".join(en.read_text().splitlines(keepends=True)[:-1]))
    result = run("prepare.sh", "--files", de, short, work=tmp_path / "w1")
    assert result.returncode != 0
    assert f"misaligned corpus: {de} has {PAIRS} lines but {short} has {PAIRS - 1}" in (
        result.stderr
    )

    holes = tmp_path / "holes.en"
    lines = en.read_text().splitlines()
    lines[6] = lines[9] = "  "
    holes.write_text("\n".join(lines) + "\n")
    result = run("prepare.sh", "--files", de, holes, work=tmp_path / "w2")
    assert result.returncode != 0
    assert f"{holes}: 2 empty line(s), at line 7, 10" in result.stderr

    tsv = tmp_path / "bad.tsv"
    tsv.write_text("Guten Tag.\tGood day.\nnur eine Spalte\n")
    result = run("prepare.sh", "--tsv", tsv, work=tmp_path / "w3")
    assert result.returncode != 0
    assert f"{tsv}:2: expected 2 tab-separated fields, got 1" in result.stderr

    result = run("prepare.sh", "--files", tmp_path / "missing.de", en, work=tmp_path / "w4")
    assert result.returncode != 0 and "missing.de not found" in result.stderr


def _bleu(report: str) -> float:
    match = re.search(r"^test BLEU:\s+([\d.]+)", report, re.MULTILINE)
    assert match, report
    return float(match.group(1))


def test_demo_pipeline_learns_resumes_skips_and_shards(tmp_path):
    de, en = toy_corpus(tmp_path)
    work = tmp_path / "work"
    command = ["bash", str(ROOT / "data" / "run_demo.sh"), "--files", str(de), str(en)]

    # Interrupt the first run as soon as training has saved a checkpoint.
    first = subprocess.Popen(
        command, env=env_for(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (work / "checkpoints" / "checkpoint_last.pt").exists():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint after 5 minutes"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(timeout=60)
    assert not (work / "done" / "train").exists()

    second = subprocess.run(command, env=env_for(work), capture_output=True, text=True,
                            timeout=600)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    assert "binarize] done already" in log and "resuming from" in log
    assert re.search(r"[Ll]oaded checkpoint \S*checkpoint_last\.pt \(epoch \d+", log)

    # One real translation per test sentence, in order, and a BLEU only a model that learnt
    # the toy language reaches.
    hyps = (work / "eval" / "ours" / "hyps.en").read_text().splitlines()
    refs = (work / "split" / "test.en").read_text().splitlines()
    assert len(hyps) == len(refs) == TEST_SIZE
    assert sum(h == r for h, r in zip(hyps, refs, strict=True)) >= TEST_SIZE // 2
    assert f"{TEST_SIZE} hypotheses for {TEST_SIZE} test sentences" in log
    assert _bleu(log) > 50
    assert re.search(r"our generator:\s+[\d.]+ sentences/s", log)
    assert re.search(r"fairseq generator:\s+[\d.]+ sentences/s", log)
    # fairseq-interactive translated each demo sentence typed on stdin.
    samples = (ROOT / "configs" / "demo_sentences.de").read_text().splitlines()
    assert len(re.findall(r"^  -> \S", log, re.MULTILINE)) == len(samples)

    # A finished run skips every step and reports the same result.
    third = run("run_demo.sh", "--files", de, en, work=work)
    assert third.returncode == 0, third.stderr
    for step in ("corpus", "split", "sentencepiece", "encode", "binarize", "train",
                 "evaluate-ours", "evaluate-fairseq"):
        assert f"{step}] done already" in third.stdout
    assert _bleu(third.stdout) == _bleu(log)

    # The same work directory refuses a different corpus.
    other = run("prepare.sh", "--files", en, de, work=work)
    assert other.returncode != 0 and "Use another work directory" in other.stderr

    # Sharded generation (3 shards at once) puts translations back in input order: the same
    # lines as one unsharded run with the same batches, and every shard did part of the work.
    batches = ("test", "--batch-size", "8")
    whole = run("generate_sharded.sh", 1, *batches, work=work)
    sharded = run("generate_sharded.sh", 3, *batches, work=work, JOBS="3")
    assert whole.returncode == 0 and sharded.returncode == 0, whole.stderr + sharded.stderr
    merged = (work / "sharded" / "test-3" / "hyps.en").read_text().splitlines()
    assert merged == (work / "sharded" / "test-1" / "hyps.en").read_text().splitlines()
    assert len(merged) == TEST_SIZE
    for shard in range(3):
        assert (work / "sharded" / "test-3" / f"shard{shard}.out").read_text().count("\nD-") > 3

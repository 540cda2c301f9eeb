"""The data pipeline end to end (data/run_demo.sh) on a small corpus this test writes.

A tiny ConvS2S (configs/smoke.conf) learns a word-for-word German-English toy language, so a
working pipeline must reach a high BLEU; the run is interrupted once during training and must
resume. Also: bad corpora stop with a clear message, finished steps are skipped, sharded
generation puts translations back in input order, and training runs under fairseq's DDP.
"""

import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_tools import PAIRS, ROOT, TEST_SIZE, VENV_BIN, env_for, toy_corpus


def run(script: str, *args: object, work: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "data" / script), *map(str, args)],
        env=env_for(work, **env), capture_output=True, text=True, timeout=600,
    )


def test_what_cannot_be_a_corpus_stops_with_a_message_naming_file_and_line(tmp_path):
    de, en = toy_corpus(tmp_path)
    short = tmp_path / "short.en"
    short.write_text("".join(en.read_text().splitlines(keepends=True)[:-1]))
    result = run("prepare.sh", "--files", de, short, work=tmp_path / "w1")
    assert result.returncode != 0
    assert f"misaligned corpus: {de} has {PAIRS} lines but {short} has {PAIRS - 1}" in (
        result.stderr
    )

    latin1 = tmp_path / "latin1.en"
    lines = en.read_bytes().splitlines(keepends=True)
    lines[8] = "The green tree falls today. Schön.\n".encode("latin-1")
    latin1.write_bytes(b"".join(lines))
    result = run("prepare.sh", "--files", de, latin1, work=tmp_path / "w2")
    assert result.returncode != 0
    assert f"{latin1}:9: not valid UTF-8: 0xf6 at byte 32 of the line" in result.stderr

    tsv = tmp_path / "bad.tsv"
    tsv.write_text("Guten Tag.\tGood day.\nnur eine Spalte\n")
    result = run("prepare.sh", "--tsv", tsv, work=tmp_path / "w3")
    assert result.returncode != 0
    assert f"{tsv}:2: expected 2 tab-separated fields, got 1" in result.stderr

    result = run("prepare.sh", "--files", tmp_path / "missing.de", en, work=tmp_path / "w4")
    assert result.returncode != 0 and "missing.de not found" in result.stderr


def _corpus_py(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "python"), str(ROOT / "data" / "corpus.py"), *map(str, args)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_cleaning_drops_empty_long_unbalanced_and_repeated_pairs_and_says_which(tmp_path):
    """Each rule of the cleaning on a corpus written here, with limits of 40 characters and a
    length ratio of 3: what is kept, what each rule dropped, and examples by line number."""
    pairs = [
        ("Guten Tag.", "Good day."),  # 1 kept
        ("", "Hello."),  # 2 empty source
        ("Hallo.", "   "),  # 3 empty target (spaces only)
        ("Ja, das ist wahr.", "Yes, that is true, " + "very " * 5 + "true."),  # 4: 17 and 49
        ("Nein.", "No, I do not think so."),  # 5: ratio 5 and 22 > 3
        ("Guten  Tag. ", " Good day."),  # 6 repeats 1 once spaces are tidied
        ("Wie geht's?", "How are you?"),  # 7 kept
        ("", ""),  # 8 both sides empty
        ("Guten Tag.", "Hello."),  # 9 kept: same source, another translation
        ("Wie geht's?", "How are you?"),  # 10 repeats 7
        ("Danke.", "Thanks."),  # 11 kept
        ("Guten Tag.", "Good day."),  # 12 repeats 1
        ("Bitte.", "Please."),  # 13 kept
        ("Tschüss.", "Bye."),  # 14 kept: ratio 8 / 4 = 2
        ("Guten Tag.", "Hello."),  # 15 repeats 9
    ]
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{de}\t{en}\r\n" for de, en in pairs), encoding="utf-8")
    result = _corpus_py("tsv", tsv, tmp_path / "all", "de", "en", 40, 3)
    assert result.returncode == 0, result.stderr
    kept = [1, 7, 9, 11, 13, 14]
    assert (tmp_path / "all.de").read_text().splitlines() == [pairs[i - 1][0] for i in kept]
    assert (tmp_path / "all.en").read_text().splitlines() == [pairs[i - 1][1] for i in kept]
    log = [
        f"corpus: {tsv}",
        "cleaning: 15 pairs read, 6 kept",
        "       3 dropped: a side is empty (line 2: empty source; line 3: empty target; "
        "line 8: empty source and target)",
        "       1 dropped: a side is longer than 40 characters (line 4: 17 and 49 characters)",
        "       1 dropped: a side is more than 3 times longer than the other "
        "(line 5: 5 and 22 characters)",
        "       4 dropped: repeats an earlier pair exactly (line 6: as line 1; line 10: as "
        "line 7; line 12: as line 1 ...)",
    ]
    assert result.stdout.splitlines() == log
    assert (tmp_path / "all.cleaning.log").read_text().splitlines() == log

    # Two files: the same rules, line numbers of both files; an empty line no longer stops.
    (tmp_path / "c.de").write_text("Ja.\n\nNein.\n")
    (tmp_path / "c.en").write_text("Yes.\nNo.\nNo.\n")
    out = tmp_path / "cleaned"
    result = _corpus_py("files", tmp_path / "c.de", tmp_path / "c.en", out, "de", "en", 40, 3)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cleaned.de").read_text() == "Ja.\nNein.\n"
    assert (tmp_path / "cleaned.en").read_text() == "Yes.\nNo.\n"
    assert "line 2: empty source" in result.stdout
    assert "cleaning: 3 pairs read, 2 kept" in result.stdout


def _load(name: str):
    # data/ holds scripts, not a package: load a helper module from its file.
    spec = importlib.util.spec_from_file_location(name, ROOT / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shard_outputs_merge_by_sentence_id_and_gaps_or_repeats_are_caught(tmp_path):
    gen_output = _load("gen_output")
    shard0, shard1 = tmp_path / "shard0.out", tmp_path / "shard1.out"
    shard0.write_text("S-2\tc\nH-2\t-0.1\tC\nD-2\t-0.1\tC .\nD-0\t-0.2\tA .\n")
    shard1.write_text("D-1\t-0.3\tB .\nD-1\t-0.9\tB2 .\nD-3\t-0.4\t\n")  # nbest 2 for 1
    assert gen_output.merge([shard1, shard0], 4) == ["A .", "B .", "C .", ""]
    with pytest.raises(gen_output.OutputError, match="1 missing .first ids \\[4\\]"):
        gen_output.merge([shard0, shard1], 5)
    assert gen_output.merge([shard0, shard1], 5, allow_missing=True)[4] is None
    with pytest.raises(gen_output.OutputError, match="sentence 2 translated twice"):
        gen_output.merge([shard0, shard0], 4)
    with pytest.raises(gen_output.OutputError, match="1 unexpected ids"):
        gen_output.merge([shard0, shard1], 3)
    closing = "Translated 1,000 sentences (9 tokens) in 2.0s (500.00 sentences/s, 4.5 tokens/s)"
    assert gen_output.speed("x\n" + closing) == (1000, 500.0)


def _bleu(report: str) -> float:
    match = re.search(r"^test BLEU:\s+([\d.]+)", report, re.MULTILINE)
    assert match, report
    return float(match.group(1))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo on the toy corpus, interrupted once in training and run again to the end."""
    corpus = tmp_path_factory.mktemp("corpus")
    de, en = toy_corpus(corpus)
    work = corpus / "work"
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

    # About two minutes on 2 free cores; a shared machine has taken over ten.
    second = subprocess.run(command, env=env_for(work), capture_output=True, text=True,
                            timeout=1800)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    return {"de": de, "en": en, "work": work, "log": log}


def test_interrupted_run_resumes_training_from_its_last_checkpoint(demo):
    assert "binarize] done already" in demo["log"] and "resuming from" in demo["log"]
    assert re.search(r"[Ll]oaded checkpoint \S*checkpoint_last\.pt \(epoch \d+", demo["log"])


def test_demo_translates_every_test_sentence_and_learns_the_toy_language(demo):
    log, work = demo["log"], demo["work"]
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


def test_reports_of_two_work_directories_compare_side_by_side(demo):
    """report.py --compare (the demo's model against configs/transformer.conf's, say): one
    line per work directory with its model, BLEU, chrF and both generators' speeds."""
    work = demo["work"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "data" / "report.py"), "--compare", str(work), str(work)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert out[0].split()[:3] == ["model", "BLEU", "chrF"] and len(out) == 3
    fields = out[1].split()
    assert fields[0] == "convs2s_tiny" and float(fields[1]) == _bleu(demo["log"])
    assert fields[-1] == str(work) and out[1] == out[2]


def test_finished_run_skips_every_step_and_work_dir_keeps_its_corpus(demo):
    again = run("run_demo.sh", "--files", demo["de"], demo["en"], work=demo["work"])
    assert again.returncode == 0, again.stderr
    for step in ("corpus", "split", "sentencepiece", "encode", "binarize", "train",
                 "evaluate-ours", "evaluate-fairseq"):
        assert f"{step}] done already" in again.stdout
    assert _bleu(again.stdout) == _bleu(demo["log"])

    other = run("prepare.sh", "--files", demo["en"], demo["de"], work=demo["work"])
    assert other.returncode != 0 and "Use another work directory" in other.stderr


def test_sharded_generation_puts_translations_back_in_input_order(demo):
    # Same batches as the unsharded evaluation (the smoke recipe's --batch-size 16: 3 batches),
    # so the merged lines must equal its lines, and each of the 3 shards gets one batch.
    work = demo["work"]
    sharded = run("generate_sharded.sh", 3, work=work, JOBS="3")
    assert sharded.returncode == 0, sharded.stderr
    merged = (work / "sharded" / "test-3" / "hyps.en").read_text().splitlines()
    assert merged == (work / "eval" / "ours" / "hyps.en").read_text().splitlines()
    for shard in range(3):
        out = (work / "sharded" / "test-3" / f"shard{shard}.out").read_text()
        assert 0 < out.count("D-") < TEST_SIZE


def _read_line(stream, seconds: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no output line within {seconds} s"
    return stream.readline()


def test_translate_sh_answers_every_line_at_once_and_names_the_lines_it_cannot_translate(demo):
    """One output line per input line, in order, each as soon as its line is in: a good line's
    translation as on its own, an empty line for a refused one, which stderr names by number."""
    good = demo["de"].read_text().splitlines()[:2]
    lines = [
        good[0].encode(),
        b"Der rote Hund\xff\xfe",  # not UTF-8: sentencepiece used to crash
        " ".join(["Hund"] * 3000).encode(),
        b"",
        "\u200b".encode(),  # a zero-width space: no sentencepiece piece at all
        good[1].encode(),
    ]
    alone = subprocess.run(
        ["bash", str(ROOT / "data" / "translate.sh")], input="\n".join(good) + "\n",
        env=env_for(demo["work"]), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    translations = alone.stdout.splitlines()
    assert len(translations) == 2 and all(translations)

    streaming = subprocess.Popen(
        ["bash", str(ROOT / "data" / "translate.sh")], env=env_for(demo["work"]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    )  # fmt: skip
    answers = []
    for line in lines:
        streaming.stdin.write(line + b"\n")
        answers.append(_read_line(streaming.stdout, 120).decode().rstrip("\n"))
    streaming.stdin.close()
    assert streaming.wait(timeout=60) == 3
    assert streaming.stdout.read() == b""
    assert answers == [translations[0], "", "", "", "", translations[1]]
    assert re.fullmatch(
        "translate.sh: line 2 not translated: not valid UTF-8: 0xff 0xfe at character 14\n"
        "translate.sh: line 3 not translated: too long: [0-9]+ tokens [(]end of sentence "
        "included[)], the model accepts at most [0-9]+; split the line\n"
        "translate.sh: line 4 not translated: empty line\n"
        "translate.sh: line 5 not translated: nothing left to translate after tokenization\n",
        streaming.stderr.read().decode(),
    )


def _updates_in_epoch_1(log: str) -> int:
    """Epoch 1's updates: its summary line, or the batches its progress lines count where the
    run was stopped between epoch 1's checkpoint and that line (the demo fixture stops the
    first run as soon as a checkpoint exists, and fairseq saves it before the summary)."""
    summary = re.search(r"\| train \| epoch 001 \|.*?\| num_updates (\d+)", log)
    if summary:
        return int(summary.group(1))
    progress = re.search(r"epoch 001:\s+\d+ / (\d+)", log)
    assert progress, log[-3000:]
    return int(progress.group(1))


def test_training_runs_under_distributed_data_parallel_on_two_cpu_processes(demo):
    work = demo["work"]
    result = run("train_ddp_cpu.sh", work=work, MAX_EPOCH="1")
    assert result.returncode == 0, result.stderr
    assert "as rank 1" in (work / "logs" / "train-ddp.rank1.log").read_text()
    assert (work / "checkpoints-ddp" / "checkpoint_best.pt").is_file()
    # Each update takes one batch per process: half the updates of one process.
    single = _updates_in_epoch_1((work / "logs" / "train.log").read_text())
    ddp = _updates_in_epoch_1((work / "logs" / "train-ddp.log").read_text())
    assert ddp == (single + 1) // 2
    # Both ranks resume from the checkpoint for a second epoch.
    resumed = run("train_ddp_cpu.sh", work=work, MAX_EPOCH="2")
    assert resumed.returncode == 0, resumed.stderr
    assert "going on to 2" in resumed.stdout
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch 2 @ ", resumed.stdout)
    assert re.search(r"\| train \| epoch 002 \|.*\| num_updates " + str(2 * ddp) + " ",
                     resumed.stdout)


def test_a_last_checkpoint_cut_short_resumes_from_the_best_one(demo):
    """fairseq copies its atomically written first checkpoint to checkpoint_last.pt: a run
    stopped during the copy leaves it truncated; the next run must still resume."""
    work = demo["work"]
    save = {"SAVE_DIR": str(work / "checkpoints-cut"), "STEP_NAME": "train-cut"}
    first = run("train.sh", work=work, MAX_EPOCH="1", **save)
    assert first.returncode == 0, first.stderr
    last = work / "checkpoints-cut" / "checkpoint_last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    resumed = run("train.sh", work=work, MAX_EPOCH="2", **save)
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint_last.pt was cut short" in resumed.stdout
    assert "resuming from checkpoint_best.pt" in resumed.stdout
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch 2 @ ", resumed.stdout)
    assert (work / "checkpoints-cut" / "checkpoint_last.pt.unreadable").read_bytes() == data[
        : len(data) // 2
    ]

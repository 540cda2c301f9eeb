"""fairseq's own command-line tools with ``--user-dir beamplugin``, run for real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fairseq_tools import N_TEST, binarized_toy_corpus, run_tool
from hostile import RunsCode

import beamplugin  # noqa: F401  (the safe loader reads the trained checkpoint below)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = binarized_toy_corpus(root)
    ckpt = root / "ckpt"
    run_tool(
        "fairseq-train", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--arch", "convs2s_tiny", "--optimizer", "nag", "--lr", "0.25", "--clip-norm", "0.1",
        "--max-tokens", "2000", "--max-update", "4", "--save-dir", str(ckpt), "--cpu",
        "--no-progress-bar", "--seed", "1",
    )  # fmt: skip
    assert (ckpt / "checkpoint_last.pt").exists()
    return data, ckpt / "checkpoint_last.pt"


def _hypothesis_ids(output: str) -> list[int]:
    return sorted(int(m) for m in re.findall(r"^H-(\d+)\t", output, flags=re.M))


@pytest.mark.parametrize(
    "batching",
    [
        ["--batch-size", "10", "--required-batch-size-multiple", "8"],
        ["--max-tokens", "100"],
        ["--batch-size", "64"],
    ],
)
def test_generate_translates_every_test_sentence(trained, batching):
    data, ckpt = trained
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(ckpt), "--beam", "4", "--cpu", "--gen-subset", "test", *batching,
    )  # fmt: skip
    assert _hypothesis_ids(out.stdout) == list(range(N_TEST))


def test_interactive_answers_every_input_line(trained):
    data, ckpt = trained
    lines = ["w1 w2 w3", "w5", "w7 w7 w8 w9 w10", "w3 w2"]
    out = run_tool(
        "fairseq-interactive", str(data), "--user-dir", "beamplugin",
        "--task", "beam_translation", "--path", str(ckpt), "--beam", "3", "--cpu",
        "--source-lang", "de", "--target-lang", "en", "--buffer-size", "3",
        "--batch-size", "3",
        stdin="\n".join(lines) + "\n",
    )  # fmt: skip
    assert _hypothesis_ids(out.stdout) == list(range(len(lines)))
    sources = re.findall(r"^S-\d+\t(.*)$", out.stdout, flags=re.M)
    assert sources == lines


def test_hostile_checkpoint_refused_by_fairseq_generate(trained, tmp_path):
    data, ckpt = trained
    marker = tmp_path / "pwned"
    state = torch.load(ckpt)
    state["extra_state"]["payload"] = RunsCode(str(marker))
    bad = tmp_path / "hostile.pt"
    torch.save(state, bad)
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(bad), "--cpu", "--gen-subset", "test", "--batch-size", "8",
        check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "refusing to load" in out.stderr and "system" in out.stderr
    assert not marker.exists()


def _interactive(ckpt: Path, data: Path, lines: list[str], *extra: str):
    return run_tool(
        "fairseq-interactive", str(data), "--user-dir", "beamplugin",
        "--task", "beam_translation", "--path", str(ckpt), "--beam", "2", "--cpu",
        "--source-lang", "de", "--target-lang", "en", "--buffer-size", "4", *extra,
        stdin="\n".join(lines) + "\n", check=False,
    )  # fmt: skip


def test_bad_lines_get_a_clear_error_or_are_listed_never_silently_lost(trained):
    data, ckpt = trained
    too_long = " ".join(["w1"] * 1100)
    lines = ["w1 w2", too_long, "", "w4 zzz-unknown ÄÖ"]
    refused = _interactive(ckpt, data, lines)
    assert refused.returncode != 0
    assert "longer than the model accepts" in refused.stderr and "#1 (1101" in refused.stderr

    skipped = _interactive(ckpt, data, lines, "--skip-invalid-size-inputs-valid-test")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    # The empty line and the line of unknown words are translated; the long one is named.
    assert _hypothesis_ids(skipped.stdout) == [0, 2, 3]
    assert "leaving out 1 over-long sentence(s)" in skipped.stderr
    assert re.search(r"ids: 1$", skipped.stderr, flags=re.M)


@pytest.mark.parametrize(
    "options, message",
    [(["--beam", "4", "--nbest", "5"], "nbest must be between"), (["--beam", "0"], "beam")],
)
def test_bad_generation_options_fail_naming_the_option(trained, options, message):
    data, ckpt = trained
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(ckpt), "--cpu", "--batch-size", "8", *options, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert re.search(rf"Error: .*{message}", out.stderr), out.stderr[-1500:]
    assert "H-" not in out.stdout


def test_training_goes_on_after_bleu_validation_with_our_generator(tmp_path):
    """--eval-bleu decodes the valid set with our generator (under inference mode) between
    updates; training must carry on from there, through its backward passes."""
    data = binarized_toy_corpus(tmp_path)
    out = run_tool(
        "fairseq-train", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--arch", "convs2s_tiny", "--optimizer", "nag", "--lr", "0.25", "--clip-norm", "0.1",
        "--max-tokens", "2000", "--max-update", "6", "--save-dir", str(tmp_path / "ckpt"),
        "--cpu", "--no-progress-bar", "--seed", "1", "--eval-bleu",
        "--eval-bleu-args", '{"beam": 2, "max_len_b": 10}', "--validate-interval-updates", "2",
    )  # fmt: skip
    log = out.stdout + out.stderr
    validation = r"valid on 'valid' subset .*\| bleu [\d.]+ .*num_updates (\d+)"
    validated = [int(n) for n in re.findall(validation, log)]
    assert validated[:2] == [2, 3] and validated[-1] == 6, validated
    assert "done training" in log

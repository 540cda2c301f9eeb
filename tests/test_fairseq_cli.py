"""fairseq's own command-line tools with ``--user-dir beamplugin``, run for real."""

from __future__ import annotations

import asyncio
import re
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq_tools import (
    N_TEST,
    assert_same_lines,
    binarized_toy_corpus,
    lines_by_sentence,
    run_in_process,
    run_tool,
)
from hostile import RunsCode
from server_tools import Server

import beamplugin  # noqa: F401  (the safe loader reads the trained checkpoint below)
from beamplugin.fairseq_plugin.precision import native_on_cpu
from beamplugin.kernels import float_products


def fairseqs_own(tool: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A reference: fairseq's own generator (``--task translation``) through fairseq-generate or
    fairseq-interactive (``tool``), run in this process on one torch thread, as run_tool's
    processes run; ``stdin`` goes in as an --input file. Only the references: each run of our
    task, what these tests are about, is a process of its own as a user starts it."""
    argv = list(args)
    with tempfile.TemporaryDirectory() as folder:
        if stdin is not None:
            lines = Path(folder) / "stdin"
            lines.write_text(stdin)
            argv += ["--input", str(lines)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out = run_in_process(tool.removeprefix("fairseq-"), argv)
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess([tool, *args], 0, out, "")


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    """The binarized toy corpus, once for the module: every model here trains on it (and
    fairseq-preprocess writes the same files each time, from a fixed seed)."""
    return binarized_toy_corpus(tmp_path_factory.mktemp("cli-data"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, toy_data):
    data = toy_data
    ckpt = tmp_path_factory.mktemp("cli") / "ckpt"
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


@pytest.mark.parametrize(
    "options",
    [
        ["--batch-size", "6"],
        ["--max-tokens", "60", "--nbest", "2", "--prefix-size", "1", "--print-alignment",
         "--match-source-len"],
    ],
    ids=["batch-size", "max-tokens-nbest-prefix-alignment-match-source-len"],
)
def test_generate_as_one_stream_prints_what_batch_after_batch_prints(trained, options):
    data, ckpt = trained
    common = ["fairseq-generate", str(data), "--user-dir", "beamplugin", "--task",
              "beam_translation", "--path", str(ckpt), "--beam", "4", "--cpu", "--gen-subset",
              "test", *options]  # fmt: skip
    continuous = run_tool(*common)
    static = run_tool(*common, "--batching", "static")
    ours, reference = lines_by_sentence(continuous.stdout), lines_by_sentence(static.stdout)
    assert sorted(ours) == sorted(reference) == list(range(N_TEST))
    for sentence_id in reference:
        assert_same_lines(ours[sentence_id], reference[sentence_id])
    report = re.search(
        r"continuous batching: (\d+) sentences decoded as one stream, at most (.*) in flight; "
        r"(\d+) sentences joined others mid-search", continuous.stderr + continuous.stdout
    )
    assert report and int(report[1]) == N_TEST and int(report[3]) > 0, continuous.stderr[-2000:]
    assert "continuous batching" not in static.stderr + static.stdout


@pytest.fixture(scope="module")
def trained_transformer(tmp_path_factory, toy_data):
    """A small pre-norm fairseq transformer with shared decoder embeddings, trained briefly
    through our task."""
    data = toy_data
    ckpt = tmp_path_factory.mktemp("cli-transformer") / "ckpt"
    run_tool(
        "fairseq-train", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim",
        "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--decoder-normalize-before",
        "--share-decoder-input-output-embed", "--optimizer", "adam", "--lr", "0.01",
        "--max-tokens", "2000", "--max-update", "120", "--save-dir", str(ckpt), "--cpu",
        "--no-progress-bar", "--seed", "1", "--no-epoch-checkpoints",
    )  # fmt: skip
    return data, ckpt / "checkpoint_last.pt"


def _transformer_generate(trained_transformer) -> list[str]:
    data, ckpt = trained_transformer
    return ["fairseq-generate", str(data), "--user-dir", "beamplugin", "--path", str(ckpt),
            "--beam", "4", "--cpu", "--gen-subset", "test", "--batch-size", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def transformer_reference(trained_transformer) -> str:
    """What fairseq's own generator prints for the transformer's test set: the same for both
    engines below, so run once."""
    common = _transformer_generate(trained_transformer)
    return fairseqs_own(*common, "--task", "translation").stdout


@pytest.mark.parametrize("engine", [[], ["--device-engine", "on"]], ids=["engine", "device"])
def test_generate_on_a_transformer_joins_mid_search_and_prints_fairseqs_hypotheses(
    trained_transformer, transformer_reference, engine
):
    common = _transformer_generate(trained_transformer)
    ours = run_tool(*common, "--task", "beam_translation", *engine)
    mine, reference = lines_by_sentence(ours.stdout), lines_by_sentence(transformer_reference)
    assert sorted(mine) == list(range(N_TEST))
    # fairseq's own batching leaves a few sentences out (our task's batching keeps them all)
    assert len(reference) >= 0.9 * N_TEST
    for sentence_id in reference:
        assert_same_lines(mine[sentence_id], reference[sentence_id])
    joined = re.search(r"(\d+) sentences joined others mid-search", ours.stderr + ours.stdout)
    assert joined and int(joined[1]) > 0, ours.stderr[-2000:]
    assert ("the device engine decodes" in ours.stderr + ours.stdout) == bool(engine)


TRANSFORMER_LINES = ["w1 w2 w3", "w5", "w7 w7 w8 w9 w10", "w3 w2", "w4 w4 w4 w6",
                     "w9 w8 w7 w6 w5 w4 w3", "w2", "w10 w1", "w6 w5 w4", "w8 w8"]


def test_interactive_on_a_transformer_joins_mid_search_and_prints_fairseqs_hypotheses(
    trained_transformer,
):
    data, ckpt = trained_transformer
    common = ["fairseq-interactive", str(data), "--user-dir", "beamplugin", "--path", str(ckpt),
              "--beam", "4", "--nbest", "2", "--cpu", "--source-lang", "de", "--target-lang",
              "en", "--buffer-size", "10", "--batch-size", "3"]  # fmt: skip
    stdin = "\n".join(TRANSFORMER_LINES) + "\n"
    ours = run_tool(*common, "--task", "beam_translation", stdin=stdin)
    fairseq = fairseqs_own(*common, "--task", "translation", stdin=stdin)
    mine, reference = lines_by_sentence(ours.stdout), lines_by_sentence(fairseq.stdout)
    assert sorted(mine) == sorted(reference) == list(range(len(TRANSFORMER_LINES)))
    for sentence_id in reference:
        assert_same_lines(mine[sentence_id], reference[sentence_id])
    joined = re.search(r"(\d+) sentences joined others mid-search", ours.stderr + ours.stdout)
    assert joined and int(joined[1]) > 0, ours.stderr[-2000:]


def test_interactive_with_constraints_prints_fairseqs_hypotheses(trained_transformer):
    """fairseq-interactive --constraints through our task: the lines' constraints (after a tab)
    decoded in one stream by our engine, printing what fairseq's generator prints."""
    data, ckpt = trained_transformer
    common = ["fairseq-interactive", str(data), "--user-dir", "beamplugin", "--path", str(ckpt),
              "--beam", "4", "--nbest", "2", "--cpu", "--source-lang", "de", "--target-lang",
              "en", "--buffer-size", "10", "--batch-size", "3", "--constraints", "unordered"]
    constraints = ["w3", "", "w7 w8\tw2", "w5", "w1 w1", "", "w9\tw4\tw10", "w6", "", "w2 w3"]
    stdin = "".join(
        f"{line}\t{c}\n" if c else f"{line}\n"
        for line, c in zip(TRANSFORMER_LINES, constraints, strict=True)
    )
    ours = run_tool(*common, "--task", "beam_translation", stdin=stdin)
    fairseq = fairseqs_own(*common, "--task", "translation", stdin=stdin)
    mine, reference = lines_by_sentence(ours.stdout), lines_by_sentence(fairseq.stdout)
    assert sorted(mine) == sorted(reference) == list(range(len(TRANSFORMER_LINES)))
    for sentence_id in reference:
        assert_same_lines(mine[sentence_id], reference[sentence_id])
    assert "served by fairseq's own" not in ours.stderr + ours.stdout
    joined = re.search(r"(\d+) sentences joined others mid-search", ours.stderr + ours.stdout)
    assert joined and int(joined[1]) > 0, ours.stderr[-2000:]
    for sentence_id, wanted in enumerate(constraints):
        (text,) = [line[2] for line in mine[sentence_id] if line[0] == "H"][:1]
        for constraint in filter(None, wanted.split("\t")):
            assert f" {constraint} " in f" {text} ", (sentence_id, constraint, text)


def test_interactive_refuses_a_line_whose_constraints_cannot_be_met_and_translates_the_rest(
    trained_transformer,
):
    """A line whose constraints cannot fit in the maximum length, where fairseq's generator
    fails the whole run: its E- line, exit status 3, and the other lines of its batch get what
    fairseq's generator gives them without it."""
    data, ckpt = trained_transformer
    common = ["fairseq-interactive", str(data), "--user-dir", "beamplugin", "--path", str(ckpt),
              "--beam", "4", "--cpu", "-s", "de", "-t", "en", "--buffer-size", "10",
              "--batch-size", "3", "--constraints", "unordered", "--max-len-b", "6"]  # fmt: skip
    lines = ["w1 w2 w3\tw3", "w5\tw1 w2 w3 w4 w5 w6 w7", "w7 w8\tw8", "w3 w2\tw2"]
    ours = run_tool(*common, "--task", "beam_translation", stdin="\n".join(lines) + "\n",
                    check=False)  # fmt: skip
    good = [line for index, line in enumerate(lines) if index != 1]
    fairseq = fairseqs_own(*common, "--task", "translation", stdin="\n".join(good) + "\n")
    assert ours.returncode == 3, ours.stderr[-2000:]
    assert re.search(r"^E-1\t.*constraints of 7 tokens", ours.stdout, flags=re.M), ours.stdout
    mine, reference = lines_by_sentence(ours.stdout), lines_by_sentence(fairseq.stdout)
    assert [line[0] for line in mine[1]] == ["S"]
    for ours_id, fairseq_id in ((0, 0), (2, 1), (3, 2)):
        assert_same_lines(mine[ours_id], reference[fairseq_id])


def _test_set_constraints(data: Path) -> list[str]:
    """Constraints for each sentence of the toy test set (data/../test.en beside data): words of
    its reference, one, two or a two-word phrase, none for every fourth, and for every
    seventh a word it lacks."""
    references = (data.parent / "test.en").read_text().splitlines()
    constraints = []
    for index, words in enumerate(line.split() for line in references):
        if index % 4 == 3:
            constraints.append("")
        elif index % 7 == 6:
            constraints.append(f"w39\t{words[0]}")
        elif index % 3 == 0 and len(words) > 2:
            constraints.append(f"{words[1]} {words[2]}\t{words[0]}")
        else:
            constraints.append(words[-1])
    return constraints


# each model and each order once (tests/test_constraints.py: the search's every combination)
@pytest.mark.parametrize(
    "model, order", [("trained", "ordered"), ("trained_transformer", "unordered")],
    ids=["convs2s-ordered", "transformer-unordered"],
)  # fmt: skip
def test_generate_with_a_constraints_file_prints_fairseqs_constrained_hypotheses(
    model, order, request, tmp_path
):
    """fairseq-generate --constraints through our task, the binarized test set's constraints
    from --constraints-file, prints (H and P lines, scores at their printed precision) what
    fairseq's own generator prints for the same sentences and constraints in
    fairseq-interactive with fairseq's translation task."""
    data, ckpt = request.getfixturevalue(model)
    constraints = _test_set_constraints(data)
    path = tmp_path / "test.constraints"
    path.write_text("".join(c + "\n" for c in constraints))
    common = ["--user-dir", "beamplugin", "--path", str(ckpt), "--beam", "4", "--cpu",
              "--batch-size", "16", "--constraints", order]  # fmt: skip
    ours = run_tool(
        "fairseq-generate", str(data), *common, "--task", "beam_translation", "--gen-subset",
        "test", "--constraints-file", str(path),
    )  # fmt: skip
    sources = (data.parent / "test.de").read_text().splitlines()
    stdin = "".join(f"{s}\t{c}\n" if c else f"{s}\n" for s, c in zip(sources, constraints,
                                                                      strict=True))  # fmt: skip
    fairseq = fairseqs_own(
        "fairseq-interactive", str(data), *common, "--task", "translation", "-s", "de", "-t",
        "en", "--buffer-size", "100", stdin=stdin,
    )  # fmt: skip
    mine, reference = lines_by_sentence(ours.stdout), lines_by_sentence(fairseq.stdout)
    assert sorted(mine) == sorted(reference) == list(range(N_TEST))
    for sentence_id in reference:
        assert_same_lines(
            [line for line in mine[sentence_id] if line[0] in "HP"],
            [line for line in reference[sentence_id] if line[0] in "HP"],
        )
    assert "served by fairseq's own" not in ours.stderr + ours.stdout
    met = [all(f" {c} " in f" {mine[i][2][2]} " for c in wanted.split("\t"))
           for i, wanted in enumerate(constraints) if wanted]  # fmt: skip
    assert sum(met) >= 0.9 * len(met)  # the constraints were in force


def test_a_constraints_file_of_another_length_is_refused_naming_it(trained, tmp_path):
    data, ckpt = trained
    path = tmp_path / "short.constraints"
    path.write_text("w1\n")
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(ckpt), "--cpu", "--gen-subset", "test", "--constraints", "ordered",
        "--constraints-file", str(path), check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert f"--constraints-file {path} has 1 lines for the split's {N_TEST} sentences" in (
        out.stderr
    )


def test_hub_translate_of_a_transformer_decodes_with_our_generator_when_asked(
    trained_transformer, monkeypatch
):
    """The README's text-in, text-out example: fairseq's hub interface, its task overridden by
    name, decodes with our engine and gives what fairseq's generator gives."""
    from fairseq.models.transformer import TransformerModel

    from beamplugin.engine import DecodingEngine

    data, ckpt = trained_transformer
    steps = []
    step = DecodingEngine.step
    monkeypatch.setattr(DecodingEngine, "step", lambda self: steps.append(1) or step(self))

    def translate(task):
        hub = TransformerModel.from_pretrained(
            str(ckpt.parent), checkpoint_file=ckpt.name, data_name_or_path=str(data),
            task={"_name": task},
        )  # fmt: skip
        return hub.translate(TRANSFORMER_LINES, beam=4)

    theirs = translate("translation")
    assert not steps
    assert translate("beam_translation") == theirs
    assert steps, "our engine did not decode"


def test_server_on_a_transformer_answers_as_interactive(trained_transformer):
    """beamplugin-serve takes the transformer checkpoint, with continuous batching (no log line
    saying it decodes batch after batch), and answers concurrent clients what
    fairseq-interactive through our task prints."""
    data, ckpt = trained_transformer
    options = [str(data), "--path", str(ckpt), "--beam", "4", "--cpu", "-s", "de", "-t", "en"]
    server = Server([*options, "--batch-size", "3"])
    try:
        expected = run_tool(
            "fairseq-interactive", "--user-dir", "beamplugin", "--task", "beam_translation",
            *options, "--buffer-size", "10", "--batch-size", "10",
            stdin="\n".join(TRANSFORMER_LINES) + "\n",
        )  # fmt: skip
        texts = {int(i): text for i, text in
                 re.findall(r"^D-(\d+)\t\S+\t(.*)$", expected.stdout, flags=re.M)}  # fmt: skip

        async def ask_all() -> list[tuple[int, dict]]:
            async with aiohttp.ClientSession() as session:
                async def ask(line: str) -> tuple[int, dict]:
                    body = {"q": line, "source": "de", "target": "en"}
                    async with session.post(server.url + "/translate", json=body) as response:
                        return response.status, await response.json()

                return await asyncio.gather(*(ask(line) for line in TRANSFORMER_LINES))

        answers = asyncio.run(asyncio.wait_for(ask_all(), 120))
    finally:
        assert server.stop() == 0
    assert answers == [(200, {"translatedText": texts[i]}) for i in range(len(TRANSFORMER_LINES))]
    assert not any("cannot decode sentences at different steps" in line for line in server.log)


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


def _interactive(ckpt: Path, data: Path, lines: list[str], buffer_size: int, **env: str):
    return run_tool(
        "fairseq-interactive", str(data), "--user-dir", "beamplugin",
        "--task", "beam_translation", "--path", str(ckpt), "--beam", "2", "--cpu",
        "--source-lang", "de", "--target-lang", "en", "--buffer-size", str(buffer_size),
        "--batch-size", "1",
        stdin="\n".join(lines) + "\n", check=False, **env,
    )  # fmt: skip


def _lines_by_id(output: str, kind: str) -> dict[int, list[str]]:
    """fairseq's output lines of one kind ("S", "H", "E", ...) by sentence id, prefix dropped."""
    found: dict[int, list[str]] = {}
    for sentence_id, rest in re.findall(rf"^{kind}-(\d+)\t(.*)$", output, flags=re.M):
        found.setdefault(int(sentence_id), []).append(rest)
    return found


def test_interactive_refuses_bad_lines_by_id_and_translates_the_others_as_alone(trained):
    """One bad line never kills the stream: it gets an E- line, every other line is translated
    exactly as on its own, ids stay line numbers, and the exit status says lines were lost.
    stdin is decoded strictly here, as under a UTF-8 locale such as en_US.UTF-8."""
    data, ckpt = trained
    models, _ = checkpoint_utils.load_model_ensemble([str(ckpt)])
    limit = models[0].encoder.max_positions()
    stream = [
        "w1 w2",
        " ".join(["w1"] * limit),
        "w4 zzz-unknown ÄÖ",
        "",
        b"w3 \xff\xfe w5".decode(errors="surrogateescape"),
        "  ",
        " ".join(["w3"] * (limit - 1)),
        "w7 w8 w9",
    ]
    refusals = {
        1: f"too long: {limit + 1} tokens (end of sentence included), the model accepts at "
        f"most {limit}; split the line",
        3: "empty line",
        4: "not valid UTF-8: 0xff 0xfe at character 4",
        5: "empty line",
    }
    good_ids = [i for i in range(len(stream)) if i not in refusals]
    good = [stream[i] for i in good_ids]

    # Buffers of 3 lines: [good, bad, good], [bad, bad, bad], [good, good].
    out = _interactive(ckpt, data, stream, 3, PYTHONIOENCODING="utf-8:strict")
    alone = _interactive(ckpt, data, good, 1)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "continuous batching" not in alone.stderr  # a line at a time: no summary each

    assert out.returncode == 3, out.stderr[-2000:]
    assert _lines_by_id(out.stdout, "E") == {i: [reason] for i, reason in refusals.items()}
    assert "4 of 8 input lines were not translated (ids 1, 3, 4, 5; see their E- lines)" in (
        out.stderr
    )
    for kind in ("S", "H", "P"):
        translated = _lines_by_id(out.stdout, kind)
        reference = _lines_by_id(alone.stdout, kind)
        assert sorted(translated) == good_ids
        assert [translated[i] for i in good_ids] == [reference[i] for i in range(len(good))]


def test_generate_still_refuses_over_long_sentences_of_a_binarized_set(trained):
    data, ckpt = trained
    options = ["--path", str(ckpt), "--cpu", "--batch-size", "8", "--max-source-positions", "6"]
    refused = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        *options, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert re.search(r"\d+ sentence\(s\) are longer than the model accepts", refused.stderr)
    assert "H-" not in refused.stdout

    skipped = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        *options, "--skip-invalid-size-inputs-valid-test",
    )  # fmt: skip
    left_out = re.search(r"leaving out (\d+) over-long sentence\(s\).*ids: ([\d ]+)$",
                         skipped.stdout + skipped.stderr, flags=re.M)  # fmt: skip
    ids = [int(i) for i in left_out.group(2).split()]
    assert len(ids) == int(left_out.group(1)) > 0
    assert _hypothesis_ids(skipped.stdout) == sorted(set(range(N_TEST)) - set(ids))


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


def test_training_goes_on_after_bleu_validation_with_our_generator(toy_data, tmp_path):
    """--eval-bleu decodes the valid set with our generator (under inference mode) between
    updates; training must carry on from there, through its backward passes."""
    out = run_tool(
        "fairseq-train", str(toy_data), "--user-dir", "beamplugin", "--task", "beam_translation",
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


def _hypotheses(output: str) -> dict[int, tuple[float, str]]:
    """Per sentence id, the score and text of its first H line."""
    found: dict[int, tuple[float, str]] = {}
    for match in re.finditer(r"^H-(\d+)\t(\S+)\t(.*)$", output, flags=re.M):
        found.setdefault(int(match[1]), (float(match[2]), match[3]))
    return found


# what the log says --bf16 runs: float32 models on bfloat16 weights where our kernel runs, else
# the models cast
BF16_FORM = (
    "products on bfloat16 weights"
    if float_products.bf16_weights_available()
    else "models in torch.bfloat16"
)


@pytest.mark.skipif(
    not native_on_cpu(torch.bfloat16), reason="without bfloat16 products --bf16 runs float32"
)
def test_generate_with_bf16_decodes_in_bfloat16(trained):
    """fairseq-generate casts the models only for --fp16; with our task --bf16 decodes in
    bfloat16 (not silently in float32): scores move by bfloat16's rounding, translations hold."""
    data, ckpt = trained
    common = ["fairseq-generate", str(data), "--user-dir", "beamplugin", "--task",
              "beam_translation", "--path", str(ckpt), "--beam", "4", "--cpu",
              "--batch-size", "16", "--gen-subset", "test"]  # fmt: skip
    bf16 = run_tool(*common, "--bf16")
    float32 = run_tool(*common)
    said = bf16.stderr + bf16.stdout
    assert "decoding in bf16" in said and BF16_FORM in said
    ours, reference = _hypotheses(bf16.stdout), _hypotheses(float32.stdout)
    assert sorted(ours) == sorted(reference) == list(range(N_TEST))
    same = [i for i in reference if ours[i][1] == reference[i][1]]
    assert len(same) >= 0.8 * N_TEST, f"{len(same)} of {N_TEST} translations equal"
    gaps = [abs(ours[i][0] - reference[i][0]) for i in same]
    assert max(gaps) > 0, "bf16 scores equal float32's: the models did not run in bfloat16"
    assert max(gaps) < 0.05, max(gaps)


@pytest.mark.skipif(
    not native_on_cpu(torch.bfloat16), reason="without bfloat16 products --bf16 runs float32"
)
def test_interactive_with_bf16_answers_every_line(trained):
    data, ckpt = trained
    lines = ["w1 w2 w3", "w5", "w7 w7 w8 w9 w10"]
    out = run_tool(
        "fairseq-interactive", str(data), "--user-dir", "beamplugin",
        "--task", "beam_translation", "--path", str(ckpt), "--beam", "3", "--cpu", "--bf16",
        "--source-lang", "de", "--target-lang", "en", stdin="\n".join(lines) + "\n",
    )  # fmt: skip
    said = out.stderr + out.stdout
    assert "decoding in bf16" in said and BF16_FORM in said
    assert _hypothesis_ids(out.stdout) == list(range(len(lines)))


@pytest.mark.skipif(native_on_cpu(torch.float16), reason="this CPU multiplies float16")
def test_fp16_on_a_cpu_without_float16_is_refused_with_a_reason(trained):
    data, ckpt = trained
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(ckpt), "--cpu", "--fp16", "--batch-size", "8", check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--fp16 on this CPU: it has no float16 arithmetic" in out.stderr, out.stderr[-1500:]
    assert "H-" not in out.stdout


def test_int8_with_a_model_too_small_for_it_is_refused_not_run_in_float32(trained):
    data, ckpt = trained
    out = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--path", str(ckpt), "--cpu", "--int8", "--batch-size", "8", check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--int8: these models have no weight for int8" in out.stderr, out.stderr[-1500:]
    assert "H-" not in out.stdout


def _map_rules(path: Path) -> dict[str, set[str]]:
    rules: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        key, targets = line.split("\t")
        rules.setdefault(key, set()).update(targets.split())
    return rules


def test_generate_with_a_vocabulary_map_takes_each_sentences_shortlist_alone(trained, tmp_path):
    """A map built by beamplugin-vocabulary-map from the training text: every hypothesis of
    fairseq-generate keeps to its sentence's shortlist (which the unrestricted search leaves);
    a strategy only fairseq's generator serves is refused with the map, not run without it."""
    data, ckpt = trained
    vmap = tmp_path / "map.txt"
    made = run_tool(
        "beamplugin-vocabulary-map", "--source", str(data.parent / "train.de"),
        "--target", str(data.parent / "train.en"), "--output", str(vmap),
        "--per-token", "2", "--frequent", "1",
    )  # fmt: skip
    assert "always" in made.stdout
    rules = _map_rules(vmap)
    common = ["fairseq-generate", str(data), "--user-dir", "beamplugin", "--task",
              "beam_translation", "--path", str(ckpt), "--beam", "4", "--cpu",
              "--batch-size", "16", "--gen-subset", "test"]  # fmt: skip
    sources = {}

    def outside_shortlists(output: str) -> int:
        for match in re.finditer(r"^S-(\d+)\t(.*)$", output, flags=re.M):
            sources[int(match[1])] = match[2].split()
        outside = 0
        for i, (_, text) in _hypotheses(output).items():
            shortlist = rules[""] | {"<unk>"}
            shortlist |= {t for word in sources[i] for t in rules.get(word, ())}
            outside += not set(text.split()) <= shortlist
        return outside

    restricted = run_tool(*common, "--vocabulary-map", str(vmap))
    assert sorted(_hypotheses(restricted.stdout)) == list(range(N_TEST))
    assert outside_shortlists(restricted.stdout) == 0
    assert outside_shortlists(run_tool(*common).stdout) > 0
    refused = run_tool(*common, "--vocabulary-map", str(vmap), "--sampling", "--nbest", "4",
                       check=False)
    assert refused.returncode != 0
    assert "--vocabulary-map needs beamplugin's generator" in refused.stderr

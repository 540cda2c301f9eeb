"""beamplugin-translate without Ray: each line gets what fairseq-interactive prints for it (its
best D- line's text), bad lines are rejected alone, nothing of Ray is imported, and a rerun
translates only the blocks that are not done (test_corpus_cluster.py: the same on Ray); with
--split-sentences, each line is its sentences translated alone and joined by its own blanks."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from corpus_tools import (
    BAD_LINES,
    block_rows,
    blocks_translated,
    outputs,
    run,
    translate_command,
    write_corpus,
)
from fairseq_tools import run_tool, toy_sentence_pairs
from server_tools import shared_toy_model

from beamplugin.corpus.cli import main
from beamplugin.corpus.inputs import expand, read_blocks, split_lines, survey

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"), 300)


@pytest.fixture(scope="module")
def local_run(toy, corpus, tmp_path_factory):
    """A job of blocks of 40 lines in a process of its own (inputs as a path and a glob), which
    says afterwards whether Ray was imported."""
    output = tmp_path_factory.mktemp("local") / "out"
    command = translate_command(toy, [corpus[0], str(corpus[1].parent / "b.*")], output,
                                "--block-lines", "40")  # fmt: skip
    script = (
        "import sys; from beamplugin.corpus.cli import main; status = main(sys.argv[1:]); "
        "print('ray imported:', any(m == 'ray' or m.startswith('ray.') for m in sys.modules)); "
        "sys.exit(status)"
    )
    done = run([sys.executable, "-c", script, *command[1:]], timeout=300)
    return done, output


def interactive_best(toy: dict[str, Path], lines: list[bytes], *extra: str) -> dict[int, str]:
    """fairseq-interactive's best D- text by line (from 0), on the same model and options (and
    ``extra``)."""
    out = run_tool(
        "fairseq-interactive", str(toy["data"]), "--user-dir", "beamplugin", "--task",
        "beam_translation", "--path", str(toy["checkpoint"]), "--bpe", "sentencepiece",
        "--sentencepiece-model", str(toy["spm"]), "-s", "de", "-t", "en", "--beam", "5",
        "--buffer-size", "64", "--batch-size", "64", *extra,
        stdin=b"".join(line + b"\n" for line in lines).decode("utf-8", "surrogateescape"),
        check=False,
    ).stdout  # fmt: skip
    return {int(i): text for i, text in re.findall(r"^D-(\d+)\t\S+\t(.*)$", out, flags=re.M)}


def test_each_line_gets_fairseq_interactives_best_translation_bad_ones_an_empty_line(
    toy, corpus, local_run
):
    done, output = local_run
    assert done.returncode == 3, done.stderr[-3000:]  # lines were rejected
    for source in corpus:
        lines = split_lines(gzip.decompress(source.read_bytes()) if source.suffix == ".gz"
                            else source.read_bytes())  # fmt: skip
        expected = interactive_best(toy, lines)
        ours = (output / f"{source.name}.en").read_text().split("\n")
        assert ours[-1] == "" and len(ours) - 1 == len(lines)  # every line ends with one
        assert ours[:-1] == [expected.get(i, "") for i in range(len(lines))]
    rejects = (output / "a.de.en.rejects.tsv").read_text().splitlines()
    assert [row.split("\t")[:2] for row in rejects] == [["a.de", str(n)] for n in BAD_LINES]
    for row, (_, reason) in zip(rejects, BAD_LINES.values(), strict=True):
        assert row.split("\t")[2].startswith(reason)
    assert (output / "b.de.gz.en.rejects.tsv").read_bytes() == b""
    assert "300 lines of 2 input file(s)" in done.stdout and "4 rejected" in done.stdout


def test_nothing_of_ray_is_imported_without_the_flag_and_parts_are_gone(local_run):
    done, output = local_run
    assert "ray imported: False" in done.stdout, done.stdout
    assert not (output / ".parts").exists()
    assert blocks_translated(done.stdout) == (8, 8, 0)


def test_a_killed_job_started_again_translates_only_the_blocks_not_done(
    toy, corpus, tmp_path, capsys
):
    """A job killed (SIGKILL) after some blocks, one of its done blocks' input changed since:
    started again, it translates that block and those not done, and writes what a job never
    stopped writes; once more, nothing. A manifest row cut short (a driver killed while
    writing it) is dropped; other decoding options are refused."""
    corpus = [Path(shutil.copy(source, tmp_path)) for source in corpus]
    output = tmp_path / "out"
    command = translate_command(toy, corpus, output, "--block-lines", "10")
    killed = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        wait_for(lambda: len(block_rows(output)) >= 5 or killed.poll() is not None, 240)
    finally:
        killed.kill()
        killed.wait()
    done = block_rows(output)
    assert 5 <= len(done) < 30, "killed too late to test anything"
    assert done[0]["input"] == "a.de"  # blocks are handed out in order
    lines = corpus[0].read_bytes().split(b"\n")
    lines[done[0]["first_line"] - 1] = b"der hund schl\xc3\xa4ft"
    corpus[0].write_bytes(b"\n".join(lines))

    assert main(command[1:]) == 3
    assert blocks_translated(capsys.readouterr().out) == (30, 31 - len(done), len(done) - 1)
    reference = tmp_path / "reference"
    assert main(translate_command(toy, corpus, reference, "--block-lines", "10")[1:]) == 3
    capsys.readouterr()
    assert outputs(output) == outputs(reference)
    assert len(block_rows(output)) == 31  # every block once, the changed one twice

    manifest = output / "manifest.jsonl"
    torn = json.dumps({"input": "b.de.gz", "first_line": 101})[:30].encode()
    manifest.write_bytes(manifest.read_bytes() + torn)
    assert main(command[1:]) == 3
    assert blocks_translated(capsys.readouterr().out) == (30, 0, 30)
    assert manifest.read_bytes().endswith(b"\n")
    assert outputs(output) == outputs(reference)
    assert main(translate_command(toy, corpus, output, "--beam", "2")[1:]) == 2


def test_split_sentences_translates_each_lines_sentences_alone_and_keeps_its_blanks(
    toy, tmp_path, capsys
):
    """A corpus of documents, one a line: each line comes back as its sentences translated
    alone (a corpus of them, one a line) and joined by the line's own blanks; a line with no
    letter is copied, an empty one stays empty, a sentence too long for the model is cut at
    blanks rather than refused, a line not UTF-8 is rejected whole; the output has the input's
    lines; a rerun translates nothing."""
    pairs = toy_sentence_pairs(12, seed=11)
    sentences = [de[0].upper() + de[1:] + end
                 for (de, _), end in zip(pairs, ".!?." * 3, strict=True)]  # fmt: skip
    layout = [  # (blanks before, [(sentence or a special line, blanks after)])
        ("", [(0, " "), (1, "  "), (2, "")]),
        ("  ", [(3, "\t")]),
        ("", []),  # an empty line
        ("", [(4, " "), (5, " ")]),
        ("", [("12. 3", "")]),  # no letter: copied
        ("", [(6, " "), (7, " "), (8, " "), (9, "")]),
        ("", [(10, " "), ("der hund " * 400, "")]),  # 2800 tokens: cut, translated
        ("", [(11, "")]),
        ("", [("Gr\udcfc\udcdfe.", "")]),  # Latin-1: not UTF-8, rejected
    ]  # fmt: skip

    def joined(words: list[str]) -> list[str]:
        return [before + "".join((words[k] if isinstance(k, int) else k) + after
                                 for k, after in parts) for before, parts in layout]  # fmt: skip

    documents, alone = tmp_path / "docs.de", tmp_path / "sentences.de"
    documents.write_bytes("".join(line + "\n" for line in joined(sentences)).encode(
        "utf-8", "surrogateescape"))  # fmt: skip
    alone.write_text("".join(sentence + "\n" for sentence in sentences))
    output, reference = tmp_path / "out", tmp_path / "reference"
    split = translate_command(toy, [documents], output, "--block-lines", "3",
                              "--split-sentences")[1:]  # fmt: skip
    assert main(split) == 3
    assert blocks_translated(capsys.readouterr().out) == (3, 3, 0)
    assert main(translate_command(toy, [alone], reference)[1:]) == 0
    capsys.readouterr()
    expected = joined((reference / "sentences.de.en").read_text().split("\n"))
    got = (output / "docs.de.en").read_text().split("\n")
    assert len(got) == len(layout) + 1 and got[-1] == ""  # a line each, each ended
    long_line = got[6].removeprefix(expected[6].partition("der hund")[0])
    assert len(long_line.split()) > 100  # every piece translated, none refused
    assert got[:6] + got[7:8] == expected[:6] + expected[7:8] and got[8] == ""
    assert (output / "docs.de.en.rejects.tsv").read_text().startswith("docs.de\t9\t")
    assert main(split) == 3
    assert blocks_translated(capsys.readouterr().out) == (3, 0, 3)


GLOSSARY = {"hund": "cat", "frau": "bird", "oft": "today"}


def test_a_glossary_puts_each_lines_terms_in_as_interactive_constraints_do(toy, tmp_path, capsys):
    """--glossary with --constraints ordered: each line translated as fairseq-interactive
    --constraints ordered translates it with the targets of the terms found in it after tabs
    (in the order found); the summary counts the terms; a changed glossary is another job."""
    lines = [de.encode() for de, _ in toy_sentence_pairs(40, 5)]
    source = tmp_path / "g.de"
    source.write_bytes(b"".join(line + b"\n" for line in lines))
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("".join(f"{s}\t{t}\n" for s, t in GLOSSARY.items()))
    command = translate_command(toy, [source], tmp_path / "out", "--block-lines", "16",
                                "--constraints", "ordered", "--glossary", str(glossary))
    assert main(command[1:]) == 0
    summary = capsys.readouterr().out
    targets = [[GLOSSARY[w] for w in dict.fromkeys(line.decode().split()) if w in GLOSSARY]
               for line in lines]  # fmt: skip
    assert sum(map(len, targets)) > 10 and not all(targets)
    assert f"glossary: {sum(map(len, targets))} terms applied" in summary
    stdin = [b"\t".join([line, *(t.encode() for t in found)]) for line, found in
             zip(lines, targets, strict=True)]  # fmt: skip
    expected = interactive_best(toy, stdin, "--constraints", "ordered")
    ours = (tmp_path / "out" / "g.de.en").read_text().splitlines()
    assert ours == [expected[i] for i in range(len(lines))]
    for text, found in zip(ours, targets, strict=True):
        assert all(target in text.split() for target in found), (text, found)
    glossary.write_text("hund\tbird\n")
    assert main(command[1:]) == 2  # the manifest's job had another glossary
    with pytest.raises(SystemExit):
        main(translate_command(toy, [source], tmp_path / "x", "--glossary", str(glossary))[1:])
    assert "--glossary needs --constraints" in capsys.readouterr().err


def test_split_sentences_with_a_glossary_gives_each_sentence_its_own_terms(
    toy, tmp_path, capsys
):
    """--split-sentences with --glossary: the terms are found in each sentence, as the server
    finds them in a document's: a line of two sentences, a term in each, comes back as each
    sentence translated alone by fairseq-interactive --constraints ordered with its own term's
    target; the line's terms applied are its sentences' sum; both options are the job's."""
    chosen: dict[str, str] = {}  # a term -> a sentence in which it is the only one, inside
    for de, _ in toy_sentence_pairs(200, seed=7):
        words = de.split()
        terms = {w for w in words if w in GLOSSARY}
        if len(terms) == 1 and len(words) > 3 and not terms & {words[0], words[-1]}:
            chosen.setdefault(terms.pop(), de)
    (term_a, first), (term_b, second) = list(chosen.items())[:2]
    sentences = [first[0].upper() + first[1:] + ".", second[0].upper() + second[1:] + "."]
    documents = tmp_path / "docs.de"
    documents.write_text(f"{sentences[0]}  {sentences[1]}\n")
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("".join(f"{s}\t{t}\n" for s, t in GLOSSARY.items()))
    command = translate_command(toy, [documents], tmp_path / "out", "--split-sentences",
                                "--constraints", "ordered", "--glossary", str(glossary))
    assert main(command[1:]) == 0
    assert "glossary: 2 terms applied" in capsys.readouterr().out
    assert [row["terms_applied"] for row in block_rows(tmp_path / "out")] == [2]
    stdin = [f"{sentences[0]}\t{GLOSSARY[term_a]}".encode(),
             f"{sentences[1]}\t{GLOSSARY[term_b]}".encode()]  # fmt: skip
    expected = interactive_best(toy, stdin, "--constraints", "ordered")
    assert (tmp_path / "out" / "docs.de.en").read_text() == f"{expected[0]}  {expected[1]}\n"
    assert GLOSSARY[term_a] in expected[0].split() and GLOSSARY[term_b] in expected[1].split()
    without_split = [arg for arg in command[1:] if arg != "--split-sentences"]
    assert main(without_split) == 2  # the manifest's job split its lines


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_block_plan_reads_gzip_and_a_last_line_without_its_end(tmp_path):
    plain, compressed = tmp_path / "x.txt", tmp_path / "y.txt"
    plain.write_bytes(b"a\nb\r\n\nc")
    compressed.write_bytes(gzip.compress(b"a\nb\r\n\nc"))
    assert expand([str(tmp_path / "*.txt")]) == [plain, compressed]
    for path in (plain, compressed):
        source = survey(path, 3)
        assert source.lines == 4 and len(source.block_sha256) == 2
        blocks = list(read_blocks(source, [0, 1]))
        assert [split_lines(b.data) for b in blocks] == [[b"a", b"b\r", b""], [b"c"]]
        assert [(b.first_line, b.lines) for b in blocks] == [(1, 3), (4, 1)]
    assert survey(plain, 3).block_sha256 == survey(compressed, 3).block_sha256
    with pytest.raises(ValueError, match="no such file"):
        expand([str(tmp_path / "*.de")])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_bytes(b"z\n")
    with pytest.raises(ValueError, match="several files named x.txt"):
        expand([str(plain), str(tmp_path / "sub" / "x.txt")])

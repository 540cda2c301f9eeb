"""Running fairseq's command-line tools from tests, on a toy corpus the tests write."""

import contextlib
import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
N_TEST = 100
WORDS = [f"w{i}" for i in range(40)]


def run_tool(tool: str, *args: str, stdin: str | None = None, check: bool = True, **env: str):
    """Run a fairseq console script from this venv, with ``env`` added to its environment; on
    failure show the end of its stderr. Lone surrogates in ``stdin`` go out as the bytes they
    stand for (surrogateescape), so a test can send bytes that are not UTF-8."""
    proc = subprocess.run(
        [str(BIN / tool), *args], input=stdin, capture_output=True, text=True,
        errors="surrogateescape", env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=REPO,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run_in_process(tool: str, argv: list[str]) -> str:
    """fairseq-generate or fairseq-interactive (``tool``) with ``argv`` in this process: what
    it prints on stdout (a process of its own would spend seconds importing torch and
    fairseq)."""
    from fairseq import options
    from fairseq_cli import generate, interactive

    parser = (options.get_generation_parser() if tool == "generate"
              else options.get_interactive_generation_parser())  # fmt: skip
    # no data loader process: once one has run here, ending the next takes seconds
    args = options.parse_args_and_arch(parser, [*argv, "--num-workers", "0"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        (generate if tool == "generate" else interactive).main(args)
    return out.getvalue()


def binarized_toy_corpus(root: Path) -> Path:
    """A learnable task (reverse the words), binarized with a joined dictionary."""
    rng = random.Random(0)
    for split, n in [("train", 400), ("valid", 20), ("test", N_TEST)]:
        src, tgt = [], []
        for _ in range(n):
            sent = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
            src.append(" ".join(sent))
            tgt.append(" ".join(reversed(sent)))
        (root / f"{split}.de").write_text("\n".join(src) + "\n")
        (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    data = root / "bin"
    run_tool(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", str(root / "train"), "--validpref", str(root / "valid"),
        "--testpref", str(root / "test"), "--destdir", str(data),
        "--joined-dictionary", "--workers", "1",
    )  # fmt: skip
    return data


def lines_by_sentence(output: str) -> dict[int, list[list[str]]]:
    """S/T/H/D/P/A lines per sentence id, fields split, in the order printed."""
    by_id: dict[int, list[list[str]]] = {}
    for line in output.splitlines():
        match = re.match(r"^([STHDPA])-(\d+)\t(.*)$", line)
        if match:
            by_id.setdefault(int(match[2]), []).append([match[1], *match[3].split("\t")])
    return by_id


# fairseq prints scores with 4 decimals: values a hair apart can round to neighbours, one unit of
# the last printed place apart (plus the float error of parsing them back).
PRINTED_UNIT = 1e-4 + 1e-9


def assert_same_lines(ours: list[list[str]], reference: list[list[str]]) -> None:
    """The same lines, printed scores equal up to one unit of their last decimal."""
    assert [line[0] for line in ours] == [line[0] for line in reference]
    for mine, theirs in zip(ours, reference, strict=True):
        if mine[0] in "HD":
            assert float(mine[1]) == pytest.approx(float(theirs[1]), abs=PRINTED_UNIT)
            assert mine[2:] == theirs[2:]
        elif mine[0] == "P":
            assert [float(x) for x in mine[1].split()] == pytest.approx(
                [float(x) for x in theirs[1].split()], abs=PRINTED_UNIT
            )
        else:
            assert mine == theirs


# A toy German-English language, word for word, for models that read and write raw text.
TOY_WORDS = {
    "der": "the", "die": "the", "rote": "red", "kleine": "small", "alte": "old",
    "hund": "dog", "katze": "cat", "mann": "man", "frau": "woman", "vogel": "bird",
    "schläft": "sleeps", "lacht": "laughs", "singt": "sings", "wartet": "waits",
    "hier": "here", "dort": "there", "heute": "today", "oft": "often",
}  # fmt: skip


def toy_sentence_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` sentences of 2 to 7 toy words and their word-for-word translations."""
    rng = random.Random(seed)
    german = sorted(TOY_WORDS)
    pairs = []
    for _ in range(count):
        words = [rng.choice(german) for _ in range(rng.randint(2, 7))]
        pairs.append((" ".join(words), " ".join(TOY_WORDS[w] for w in words)))
    return pairs


def sentencepiece_toy_model(root: Path, updates: int = 60) -> dict[str, Path]:
    """A convs2s_tiny trained for ``updates`` steps on the toy language through a joint
    sentencepiece model: what beamplugin-serve and fairseq-interactive --bpe sentencepiece need
    (``data``, ``checkpoint``, ``spm``)."""
    import sentencepiece as spm

    pairs = {"train": toy_sentence_pairs(600, 0), "valid": toy_sentence_pairs(20, 1)}
    raw = root / "raw.txt"
    raw.write_text("".join(f"{de}\n{en}\n" for de, en in pairs["train"]))
    spm.SentencePieceTrainer.train(
        input=str(raw), model_prefix=str(root / "spm"), vocab_size=60, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2,
    )  # fmt: skip
    processor = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    for split, split_pairs in pairs.items():
        for side, lang in enumerate(("de", "en")):
            lines = processor.encode([pair[side] for pair in split_pairs], out_type=str)
            (root / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in lines))
    data = root / "bin"
    run_tool(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", str(root / "train"), "--validpref", str(root / "valid"),
        "--destdir", str(data), "--joined-dictionary", "--workers", "1",
    )  # fmt: skip
    run_tool(
        "fairseq-train", str(data), "--user-dir", "beamplugin", "--task", "beam_translation",
        "--arch", "convs2s_tiny", "--optimizer", "adam", "--lr", "0.01", "--clip-norm", "0.1",
        "--max-tokens", "1500", "--max-update", str(updates), "--save-dir", str(root / "ckpt"),
        "--cpu", "--no-progress-bar", "--seed", "1", "--no-epoch-checkpoints", "--log-interval",
        "1000", "--disable-validation",
    )  # fmt: skip
    return {"data": data, "checkpoint": root / "ckpt" / "checkpoint_last.pt",
            "spm": root / "spm.model"}  # fmt: skip

"""A tiny multilingual model of fairseq's task ``translation_multi_simple_epoch`` for tests: three
toy languages (de, en, fr: words ``de0 ... de11``, ...; a sentence's translation is its words in
the other language), four pairs, one dictionary, a 2+2-layer transformer trained for a few
seconds with M2M-100's language tokens (through task beam_translation_multi)."""

from __future__ import annotations

import random
from pathlib import Path

from fairseq.data import Dictionary, indexed_dataset
from fairseq_tools import run_tool

LANGUAGES = ["de", "en", "fr"]
PAIRS = ["de-en", "de-fr", "en-fr", "fr-de"]
WORDS = 12
SENTENCES = {"train": 300, "test": 10}  # per pair
# How the model is decoded: as it was trained (M2M-100's flags), and, as tests of the other ways
# fairseq puts language tokens (the model does not know them: what counts is that ours decodes
# as fairseq's does), the target's token on the source side, and the language tokens in place
# of the source's EOS and of the hypotheses' BOS.
LANGTOKS = {
    "m2m": ["--encoder-langtok", "src", "--decoder-langtok"],
    "encoder-tgt": ["--encoder-langtok", "tgt", "--decoder-langtok"],
    "replacing-bos-eos": ["--encoder-langtok", "src", "--decoder-langtok",
                          "--lang-tok-replacing-bos-eos"],
}  # fmt: skip


def toy_line(lang: str, rng: random.Random) -> str:
    return " ".join(f"{lang}{rng.randrange(WORDS)}" for _ in range(rng.randint(1, 8)))


def source_lines(pair: str) -> list[str]:
    """The source lines of ``pair``'s test set."""
    rng = random.Random(pair)
    return [toy_line(pair[:2], rng) for _ in range(SENTENCES["test"])]


def multilingual_data(root: Path) -> Path:
    """A data directory: one dictionary for all languages (``dict.<lang>.txt``, and
    ``dict.txt`` for --fixed-dictionary), each pair's train and test sets binarized."""
    data = root / "data"
    data.mkdir(parents=True)
    dictionary = Dictionary()
    for lang in LANGUAGES:
        for i in range(WORDS):
            dictionary.add_symbol(f"{lang}{i}")
    dictionary.finalize(padding_factor=1)
    for name in ["dict", *(f"dict.{lang}" for lang in LANGUAGES)]:
        dictionary.save(str(data / f"{name}.txt"))
    rng = random.Random(0)
    for pair in PAIRS:
        lines = {"train": [toy_line(pair[:2], rng) for _ in range(SENTENCES["train"])],
                 "test": source_lines(pair)}  # fmt: skip
        for split, sources in lines.items():
            for lang in pair.split("-"):
                prefix = data / f"{split}.{pair}.{lang}"
                builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap",
                                                       vocab_size=len(dictionary))  # fmt: skip
                for line in sources:
                    words = line.replace(pair[:2], lang)
                    builder.add_item(dictionary.encode_line(words, add_if_not_exist=False))
                builder.finalize(f"{prefix}.idx")
    return data


def task_options(data: Path, langtoks: str = "m2m") -> list[str]:
    """The task's options, for training and decoding alike (as M2M-100's README gives them)."""
    return [str(data), "--lang-pairs", ",".join(PAIRS), *LANGTOKS[langtoks],
            "--fixed-dictionary", str(data / "dict.txt")]  # fmt: skip


def trained_model(root: Path) -> tuple[Path, Path]:
    """The data directory and a checkpoint trained on it for 60 updates (seconds), through our
    task (fairseq's would train the same)."""
    data = multilingual_data(root)
    run_tool(
        "fairseq-train", *task_options(data), "--user-dir", "beamplugin",
        "--task", "beam_translation_multi", "--arch", "transformer",
        "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16",
        "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.01",
        "--max-tokens", "2000", "--max-update", "60", "--save-dir", str(root / "ckpt"), "--cpu",
        "--no-progress-bar", "--seed", "1", "--no-epoch-checkpoints", "--disable-validation",
        "--num-workers", "0",
    )  # fmt: skip
    return data, root / "ckpt" / "checkpoint_last.pt"

"""A joint sentencepiece model for both languages, and encoding with it.

  spm.py train MODEL_PREFIX VOCAB_SIZE FILE...   learn MODEL_PREFIX.model from all FILEs
  spm.py encode MODEL IN OUT                     one line of space-separated pieces per line
"""

from __future__ import annotations

import sys
from pathlib import Path

import sentencepiece as spm

SAMPLE_SENTENCES = 300_000


def train(model_prefix: str, vocab_size: int, inputs: list[str]) -> None:
    spm.SentencePieceTrainer.train(
        input=inputs,
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        # A small corpus may not support the asked vocabulary; take what it supports.
        hard_vocab_limit=False,
        character_coverage=1.0,
        # BPE keeps frequent words whole even when the corpus is tiny (unigram shreds them).
        model_type="bpe",
        # A large corpus: learn from a random sample, so this step takes seconds on any corpus.
        input_sentence_size=SAMPLE_SENTENCES,
        shuffle_input_sentence=True,
        num_threads=2,
        minloglevel=1,
    )


def encode(model: str, source: Path, target: Path) -> int:
    processor = spm.SentencePieceProcessor(model_file=model)
    lines = source.read_text(encoding="utf-8").splitlines()
    pieces = processor.encode(lines, out_type=str)
    target.write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
    return len(lines)


def main(argv: list[str]) -> None:
    if len(argv) >= 4 and argv[0] == "train":
        train(argv[1], int(argv[2]), argv[3:])
        size = spm.SentencePieceProcessor(model_file=argv[1] + ".model").get_piece_size()
        print(f"spm: {argv[1]}.model with {size} pieces")
    elif len(argv) == 4 and argv[0] == "encode":
        print(f"spm: {encode(argv[1], Path(argv[2]), Path(argv[3]))} lines of {argv[2]} encoded")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

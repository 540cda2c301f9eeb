"""The transformer benchmark of benchmarks/generate.py at the sizes people deploy: fairseq,
ours (float32, ``--int8``) and CTranslate2 (float32, int8) on fairseq checkpoints of the standard
architectures with random weights, built here.

A trained model's speed depends on its shape and on how long its outputs are, not on what its
weights say: random weights (fairseq's own initialisation, seed 1) give the real shapes without
the weeks of training, and every system still decodes the same checkpoint, so its best
hypotheses are compared with fairseq's as on a trained one. A random model rarely ends a
hypothesis early, so each runs to the maximum length: ``--max-len-b`` (default 40, max_len_a 0)
sets how many decoder steps every sentence takes, as the issue's own measurement did.

Models (``--models``, default all):

* ``base``: ``transformer_wmt_en_de`` (6+6 layers x 512, ffn 2048, 8 heads, post-norm);
* ``big``: ``transformer_vaswani_wmt_en_de_big`` (6+6 x 1024, ffn 4096, 16 heads);
* ``nllb-600m``: ``transformer`` shaped as NLLB-200's 600M distilled model (12+12 x 1024, ffn
  4096, 16 heads, pre-norm), its 256,206 words;

all with one dictionary for source and target and shared embeddings
(``--share-all-embeddings``), base and big of 32,768 words (a joined 32k BPE). ``--scale tiny``
builds the same architectures at 2+2 layers x 64 (ffn 128, 4 heads) and 1,024 words: for the
tests and smoke runs. Each model is built once into ``--cache-dir`` (``model.pt`` and ``data/``,
task ``translation`` from ``src`` to ``tgt``: dictionaries and a binarized ``test`` split of
random sentences of 8 to 40 words, real sentences' lengths) and reused while its recipe is
unchanged. A checkpoint is saved as fairseq's trainer saves one, so fairseq-generate,
``checkpoint_utils.load_model_ensemble_and_task`` and ``ct2-fairseq-converter`` load it.
nllb-600m is 615M parameters: 2.5 GB of float32 on disk, and as much in memory for each system.

    python -m benchmarks.model_sizes --batch-sizes 1 64 --threads 1 2
    python -m benchmarks.model_sizes --scale tiny --batch-sizes 1 4 --threads 1 \\
        --repeats 1 --sentences 8
    python -m benchmarks.model_sizes --models nllb-600m --shortlist 50 --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from benchmarks.common import add_results_option
from benchmarks.generate import measure, test_set_options, timing_options
from benchmarks.models import SEED, SHAPES, build, shape


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--scale", choices=["real", "tiny"], default="real")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path.home() / ".cache" / "beamplugin" / "bench-models")
    test_set_options(parser)
    timing_options(parser, max_len_b=40)
    add_results_option(parser)
    parser.add_argument("--shortlist", type=int, default=0, metavar="K",
                        help="time shortlists too (the vmap systems): a map in which every "
                        "source word lists K target words (seeded at random) and every "
                        f"sentence may take the first {ALWAYS_LISTED} words")
    return parser.parse_args()


ALWAYS_LISTED = 500  # beamplugin-vocabulary-map's default --frequent


def write_vocabulary_map(path: Path, words: int, per_word: int) -> Path:
    """A map of ``words`` words (ids 4 on: fairseq's special symbols first) in which each lists
    ``per_word`` target words drawn at random, and every sentence may take the first
    ALWAYS_LISTED: random models have no word alignment, a map of real sizes is what is timed."""
    rng = random.Random(SEED)
    names = [f"w{index}" for index in range(words - 4)]
    with open(path, "w", encoding="utf-8") as out:
        out.write(f"\t{' '.join(names[:ALWAYS_LISTED])}\n")
        for name in names:
            out.write(f"{name}\t{' '.join(rng.sample(names, per_word))}\n")
    return path


def main() -> None:
    args = parse_args()
    for name in args.models:
        checkpoint, data = build(name, args.scale, args.cache_dir)
        print(f"\n# {name} ({args.scale}): {shape(name, args.scale)}")
        if args.shortlist:
            words = shape(name, args.scale).words
            vmap = checkpoint.parent / f"vmap-{args.shortlist}.txt"
            args.vocabulary_map = write_vocabulary_map(vmap, words, args.shortlist)
            print(f"# shortlists: {vmap}, {args.shortlist} words a source word, "
                  f"{ALWAYS_LISTED} for every sentence")
        args.label = name if args.scale == "real" else f"{name}-{args.scale}"
        measure(str(checkpoint), str(data), args)


if __name__ == "__main__":
    main()

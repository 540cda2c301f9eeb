"""The transformer benchmark of scripts/bench_transformer.py at the sizes people deploy: fairseq,
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

    python scripts/bench_model_sizes.py --batch-sizes 1 64 --threads 1 2
    python scripts/bench_model_sizes.py --scale tiny --batch-sizes 1 4 --threads 1 \\
        --repeats 1 --sentences 8
    python scripts/bench_model_sizes.py --models nllb-600m --shortlist 50 --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from bench_transformer import measure, test_set_options, timing_options

SEED = 1
TEST_SENTENCES = 1000
SENTENCE_WORDS = (8, 40)  # each sentence's words (EOS not counted), as real sentences run


@dataclass(frozen=True)
class Shape:
    """A model to build: fairseq's architecture, the fairseq-train options on top of it, the
    sizes of encoder and decoder alike (layers, width, ffn width, heads: given explicitly even
    where they are the architecture's own) and the dictionary's size (fairseq's four special
    symbols included)."""

    arch: str
    options: tuple[str, ...]
    sizes: tuple[int, int, int, int]
    words: int

    def train_options(self) -> list[str]:
        """The fairseq-train options of this model."""
        what = ("layers", "embed-dim", "ffn-embed-dim", "attention-heads")
        sized = [option for side in ("encoder", "decoder") for name, size in zip(what, self.sizes,
                 strict=True) for option in (f"--{side}-{name}", str(size))]  # fmt: skip
        return ["--arch", self.arch, *self.options, *sized]

    def __str__(self) -> str:
        layers, width, ffn, heads = self.sizes
        return (f"{self.arch} {' '.join(self.options)}: {layers}+{layers} layers x {width}, "
                f"ffn {ffn}, {heads} heads, {self.words:,} words")


SHARED = ("--share-all-embeddings",)
PRE_NORM = ("--encoder-normalize-before", "--decoder-normalize-before")
SHAPES = {
    "base": Shape("transformer_wmt_en_de", SHARED, (6, 512, 2048, 8), 32_768),
    "big": Shape("transformer_vaswani_wmt_en_de_big", SHARED, (6, 1024, 4096, 16), 32_768),
    "nllb-600m": Shape("transformer", (*SHARED, *PRE_NORM), (12, 1024, 4096, 16), 256_206),
}
# Tiny, yet the shared embeddings (the output projection) of 1024 x 64 reach the 65,536 elements
# from which ``--int8`` multiplies a weight in int8: else "ours int8" would not run.
TINY_SIZES, TINY_WORDS = (2, 64, 128, 4), 1024


def shape(name: str, scale: str) -> Shape:
    """Model ``name`` at ``scale``: "real", or "tiny" (the same architecture and options at
    tiny sizes)."""
    real = SHAPES[name]
    return real if scale == "real" else replace(real, sizes=TINY_SIZES, words=TINY_WORDS)


def build(name: str, scale: str, cache: Path) -> tuple[Path, Path]:
    """(checkpoint, data directory) of model ``name`` at ``scale``, built into
    ``cache/<name>[-tiny]/`` unless a build of the same recipe is there already."""
    model = shape(name, scale)
    root = cache / (name if scale == "real" else f"{name}-{scale}")
    recipe = json.dumps({"options": model.train_options(), "words": model.words, "seed": SEED,
                         "sentences": TEST_SENTENCES, "lengths": SENTENCE_WORDS})  # fmt: skip
    checkpoint, data, stamp = root / "model.pt", root / "data", root / "recipe.json"
    if checkpoint.exists() and stamp.exists() and stamp.read_text(encoding="utf-8") == recipe:
        return checkpoint, data
    stamp.unlink(missing_ok=True)  # the files are about to change
    data.mkdir(parents=True, exist_ok=True)
    write_data(data, model.words)
    write_checkpoint(checkpoint, data, model)
    stamp.write_text(recipe, encoding="utf-8")  # last: a build cut short is not reused
    return checkpoint, data


def write_data(data: Path, words: int) -> None:
    """dict.src.txt = dict.tgt.txt of ``words`` entries (fairseq's 4 special symbols and
    ``w0`` ...), and the test split of random sentences, each side as fairseq-preprocess
    binarizes it (mmap, EOS at the end)."""
    import torch
    from fairseq.data import Dictionary, indexed_dataset

    dictionary = Dictionary()
    for index in range(words - dictionary.nspecial):
        dictionary.add_symbol(f"w{index}")
    rng = random.Random(SEED)
    for side in ("src", "tgt"):
        dictionary.save(str(data / f"dict.{side}.txt"))
        prefix = data / f"test.src-tgt.{side}"
        builder = indexed_dataset.make_builder(f"{prefix}.bin", "mmap", vocab_size=len(dictionary))
        for _ in range(TEST_SENTENCES):
            length = rng.randint(*SENTENCE_WORDS)
            ids = [rng.randrange(dictionary.nspecial, len(dictionary)) for _ in range(length)]
            builder.add_item(torch.tensor([*ids, dictionary.eos()]))
        builder.finalize(f"{prefix}.idx")


def write_checkpoint(checkpoint: Path, data: Path, model_shape: Shape) -> None:
    """A model of ``model_shape`` with fairseq's random initialisation (seed SEED; scaled as for
    training: embeddings of variance 1/width, attention projections Xavier-uniform, torch's
    defaults elsewhere, so activations stay in range through every layer), saved with the fields
    and cfg of fairseq's trainer."""
    import torch
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data.resolve()), "--task", "translation", "--source-lang", "src",
        "--target-lang", "tgt", *model_shape.train_options(),
        "--optimizer", "adam", "--criterion", "cross_entropy", "--cpu",
    ])  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(SEED)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    state = {
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(),
        "criterion": None,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "Adam", "lr_scheduler_state": {"best": None},
                               "num_updates": 0}],  # fmt: skip
        "task_state": {},
        "extra_state": {},
    }
    checkpoint_utils.torch_persistent_save(state, str(checkpoint))  # atomic: .tmp, then renamed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--scale", choices=["real", "tiny"], default="real")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path.home() / ".cache" / "beamplugin" / "bench-models")
    test_set_options(parser)
    timing_options(parser, max_len_b=40)
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
        measure(str(checkpoint), str(data), args)


if __name__ == "__main__":
    main()

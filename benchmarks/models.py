"""The models benchmarks decode, and their sentences: fairseq's fconv and our convs2s on the
same weights (random, of the fconv_iwslt_de_en shape, or a checkpoint's), prepared as
fairseq-generate prepares them; and fairseq checkpoints of the transformer sizes people deploy
with random weights, built on disk (``build``: the model sizes benchmark and its tests).
"""

from __future__ import annotations

import argparse
import json
import random
from argparse import Namespace
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.fconv import FConvModel

import beamplugin  # noqa: F401  (registers convs2s, safe checkpoint loading)
from beamplugin.models.convs2s import ConvS2SModel

Batch = dict[str, Any]

# ---------------------------------------------------------------------------------------------
# fconv and convs2s on the same weights


def random_fconv(vocab_size: int, seed: int) -> tuple[FConvModel, Dictionary, Namespace]:
    """An fconv_iwslt_de_en-shaped model with random weights, sharpened so that outputs end at
    varied lengths (a random model otherwise rambles on to max length)."""
    dictionary = Dictionary()
    for index in range(vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{index}")
    dictionary.finalize(padding_factor=8)
    args = Namespace(max_source_positions=1024, max_target_positions=1024, arch="fconv_iwslt_de_en")
    ARCH_CONFIG_REGISTRY["fconv_iwslt_de_en"](args)
    task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(seed)
    model = FConvModel.build_model(args, task)
    with torch.no_grad():
        model.decoder.fc3.weight_g.mul_(10)
        model.decoder.fc3.bias[dictionary.eos()] += 4.5
    return model.eval(), dictionary, args


def random_batches(dictionary: Dictionary, n: int, batch_size: int, seed: int) -> list[Batch]:
    """IWSLT-like source lengths (5 to 40 words), left-padded and ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    sentences = [
        torch.cat(
            [
                torch.randint(dictionary.nspecial, len(dictionary), (int(length),), generator=g),
                torch.tensor([dictionary.eos()]),
            ]
        )
        for length in torch.randint(5, 41, (n,), generator=g)
    ]
    return [collate(sentences[i : i + batch_size], dictionary, i) for i in range(0, n, batch_size)]


def collate(sentences: list[torch.Tensor], dictionary: Dictionary, first_id: int) -> Batch:
    return {
        "id": torch.arange(first_id, first_id + len(sentences)),
        "net_input": {
            "src_tokens": data_utils.collate_tokens(sentences, dictionary.pad(), left_pad=True),
            "src_lengths": torch.tensor([s.numel() for s in sentences]),
        },
    }


def checkpoint_models(path: str, data: str) -> tuple[FConvModel, ConvS2SModel, Any]:
    """fconv and convs2s with the weights of an fconv or a convs2s checkpoint, and its task."""
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data}
    )
    model = models[0]
    if not isinstance(model, FConvModel | ConvS2SModel):
        raise SystemExit(f"{path} holds a {type(model).__name__}, not an fconv/convs2s model")
    args = cfg.model if isinstance(cfg.model, Namespace) else Namespace(**dict(cfg.model))
    args.arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    if isinstance(model, FConvModel):
        return model.eval(), same_weights(ConvS2SModel, model, args, task, "fconv"), task
    return same_weights(FConvModel, model, args, task, "convs2s"), model.eval(), task


def benchmark_models(args: argparse.Namespace) -> tuple[FConvModel, ConvS2SModel, Any, str]:
    """fconv and convs2s with the same weights (``--random`` or ``--path``/``--data``), their
    task (or a stand-in holding the dictionaries), and a description of where they come from."""
    if args.random:
        fconv, dictionary, model_args = random_fconv(8000, args.seed)
        task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
        convs2s = same_weights(ConvS2SModel, fconv, model_args, task, "fconv")
        return fconv, convs2s, task, f"random fconv_iwslt_de_en, {len(dictionary)} words"
    fconv, convs2s, task = checkpoint_models(args.path, args.data)
    return fconv, convs2s, task, f"{args.path} on {args.data}:{args.gen_subset}"


def checkpoint_batches(task: Any, subset: str, n: int, batch_size: int) -> list[Batch]:
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    indices = list(range(min(n, len(dataset))))
    return [
        dataset.collater([dataset[i] for i in indices[start : start + batch_size]])
        for start in range(0, len(indices), batch_size)
    ]


def same_weights(
    model_class: type, source: torch.nn.Module, args: Namespace, task: Any, family: str
) -> torch.nn.Module:
    """A ``model_class`` (fconv or convs2s) with the weights of ``source``, a model of the other
    one: same parameter names and shapes, so a strict load."""
    other = "convs2s" if family == "fconv" else "fconv"
    new_args = Namespace(**vars(args))
    arch = str(args.arch).replace(family, other, 1)
    new_args.arch = arch if arch in ARCH_CONFIG_REGISTRY else other
    ARCH_CONFIG_REGISTRY[new_args.arch](new_args)
    dictionaries = Namespace(
        source_dictionary=task.source_dictionary, target_dictionary=task.target_dictionary
    )
    model = model_class.build_model(new_args, dictionaries)
    model.load_state_dict(source.state_dict(), strict=True)
    return model.eval()


def prepare(model: torch.nn.Module, beam: int) -> torch.nn.Module:
    """As fairseq-generate: BeamableMM for this beam, no attention kept, weight norm folded."""
    cfg = Namespace(generation=Namespace(beam=beam, print_alignment=False, no_beamable_mm=False))
    model.prepare_for_inference_(cfg)  # also puts it in eval mode for good
    return model


# ---------------------------------------------------------------------------------------------
# random transformer checkpoints of the sizes people deploy

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
    from fairseq.data import indexed_dataset

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
    from fairseq import options, tasks
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

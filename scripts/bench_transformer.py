"""A fairseq transformer checkpoint decoded by fairseq's generator, ours and CTranslate2, side by
side in one run: sentences/s at each batch size and thread count, each against fairseq's and
against CTranslate2 float32, the share of best hypotheses equal to fairseq's, and BLEU.

Systems (beam 5, lenpen 1, max_len_b 200, one test-set order sorted by source length, batches of
B consecutive sentences, as fairseq-generate makes them):

* ``fairseq``: fairseq's SequenceGenerator;
* ``ours`` / ``ours int8``: beamplugin's SequenceGenerator (the engine, the transformer mixing
  steps), in float32 and with ``--int8``'s products;
* ``ct2 float32`` / ``ct2 int8``: CTranslate2 on the same weights (``ct2-fairseq-converter``),
  ``translate_batch`` with ``max_batch_size`` B, intra_threads = the thread count.

Each round runs the systems in a shuffled order; the median over rounds is printed, with the
CPU's model name and flags. CTranslate2 is a benchmark-only dependency:
``pip install -e '.[bench]'``.

    python scripts/bench_transformer.py --path CHECKPOINT --data DATA_BIN \\
        --sentences 256 --batch-sizes 1 64 --threads 1 2
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sacrebleu
import torch
from bench_generate import cpu_description
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

import beamplugin  # noqa: F401  (registers the task, safe checkpoint loading)
from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin.precision import cast_for_decoding

BEAM, MAX_LEN_B = 5, 200
Decode = Callable[[list[torch.Tensor], int], list[list[int]]]


def checkpoint_parser(description: str) -> argparse.ArgumentParser:
    """The options of the transformer benchmarks: a checkpoint, its test set, batch sizes."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="a fairseq transformer checkpoint")
    parser.add_argument("--data", required=True, help="its binarized data directory")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    return parser


def parse_args() -> argparse.Namespace:
    parser = checkpoint_parser(__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--batch-1-sentences", type=int, default=60,
                        help="sentences timed at batch size 1 (it is slow for fairseq)")
    return parser.parse_args()


def fairseq_decode(generator: object, model: torch.nn.Module, pad: int) -> Decode:
    def decode(sources: list[torch.Tensor], batch: int) -> list[list[int]]:
        best = []
        for first in range(0, len(sources), batch):
            group = sources[first : first + batch]
            width = max(len(s) for s in group)
            tokens = torch.full((len(group), width), pad, dtype=torch.long)
            for row, s in enumerate(group):
                tokens[row, width - len(s) :] = s
            lengths = torch.tensor([len(s) for s in group])
            sample = {"net_input": {"src_tokens": tokens, "src_lengths": lengths}}
            with torch.inference_mode():
                out = generator.generate([model], sample)
            best.extend(hypos[0]["tokens"].tolist() for hypos in out)
        return best

    return decode


def ct2_model(path: str, data: str, quantization: str | None, workdir: Path) -> Path:
    out = workdir / f"ct2-{quantization or 'float32'}"
    # ct2-fairseq-converter, after beamplugin made fairseq's checkpoint loading work under
    # torch's weights_only unpickler (and registered the task the checkpoint may name)
    convert = "import sys, beamplugin; from ctranslate2.converters.fairseq import main; main()"
    command = [sys.executable, "-c", convert, "--model_path", path, "--data_dir", data,
               "--output_dir", str(out)]
    if quantization:
        command += ["--quantization", quantization]
    subprocess.run(command, check=True, capture_output=True)
    return out


def ct2_decode(model_dir: Path, compute_type: str, threads: int, dictionary: object) -> Decode:
    import ctranslate2

    translator = ctranslate2.Translator(
        str(model_dir), device="cpu", compute_type=compute_type, intra_threads=threads,
        inter_threads=1,
    )  # fmt: skip
    eos = dictionary.eos()

    def decode(sources: list[torch.Tensor], batch: int) -> list[list[int]]:
        words = [[dictionary[t] for t in s.tolist() if t != eos] for s in sources]
        results = translator.translate_batch(
            words, beam_size=BEAM, max_batch_size=batch, length_penalty=1.0,
            max_decoding_length=MAX_LEN_B, return_scores=False,
        )  # fmt: skip
        return [[dictionary.index(w) for w in r.hypotheses[0]] + [eos] for r in results]

    return decode


def main() -> None:
    args = parse_args()
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    model = models[0].eval()
    int8_model = copy.deepcopy(model)
    cast_for_decoding([int8_model], "int8")
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    count = min(args.sentences, len(dataset))
    items = [dataset[i] for i in range(count)]
    items.sort(key=lambda item: len(item["source"]))
    sources = [item["source"] for item in items]
    references = [tgt_dict.string(item["target"], "sentencepiece") for item in items]
    options = dict(beam_size=BEAM, max_len_b=MAX_LEN_B)
    systems: dict[str, Callable[[int], Decode]] = {
        "fairseq": lambda t: fairseq_decode(
            FairseqGenerator([model], tgt_dict, **options), model, src_dict.pad()
        ),
        "ours": lambda t: fairseq_decode(
            SequenceGenerator([model], tgt_dict, **options), model, src_dict.pad()
        ),
        "ours int8": lambda t: fairseq_decode(
            SequenceGenerator([int8_model], tgt_dict, **options), int8_model, src_dict.pad()
        ),
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench-transformer-"))
    try:
        import ctranslate2  # noqa: F401

        float32_dir = ct2_model(args.path, args.data, None, workdir)
        int8_dir = ct2_model(args.path, args.data, "int8", workdir)
        systems["ct2 float32"] = lambda t: ct2_decode(float32_dir, "float32", t, tgt_dict)
        systems["ct2 int8"] = lambda t: ct2_decode(int8_dir, "int8", t, tgt_dict)
    except ImportError:
        print("# ctranslate2 is not installed (pip install -e '.[bench]'): without CTranslate2")
    print(f"# {args.path}; beam {BEAM}; {cpu_description()}; torch {torch.__version__}")
    rng = random.Random(1)
    for threads in args.threads:
        torch.set_num_threads(threads)
        decoders = {name: make(threads) for name, make in systems.items()}
        for batch in args.batch_sizes:
            subset = sources if batch > 1 else sources[: args.batch_1_sentences]
            outputs = {name: decode(subset, batch) for name, decode in decoders.items()}  # warm
            seconds: dict[str, list[float]] = {name: [] for name in decoders}
            for _ in range(args.repeats):
                order = list(decoders)
                rng.shuffle(order)
                for name in order:
                    start = time.perf_counter()
                    decoders[name](subset, batch)
                    seconds[name].append(time.perf_counter() - start)
            report(threads, batch, subset, seconds, outputs, references, tgt_dict)


def report(threads: int, batch: int, subset: list, seconds: dict, outputs: dict,
           references: list[str], dictionary: object) -> None:
    median = {name: statistics.median(s) for name, s in seconds.items()}
    base = median["fairseq"]
    ct2, ct2_int8 = median.get("ct2 float32"), median.get("ct2 int8")
    print(f"\n## {threads} thread(s), batch {batch}: {len(subset)} sentences, "
          f"median of {len(next(iter(seconds.values())))} rounds")
    for name, time_taken in median.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs["fairseq"], strict=True))
        text = [dictionary.string(torch.tensor(h), "sentencepiece") for h in outputs[name]]
        bleu = sacrebleu.corpus_bleu(text, [references[: len(text)]]).score
        against_ct2 = (
            f"  x{ct2 / time_taken:5.2f} ct2 float32  x{ct2_int8 / time_taken:5.2f} ct2 int8"
            if ct2 and ct2_int8 else ""
        )
        print(f"{name:12s} {len(subset) / time_taken:7.1f} sent/s  x{base / time_taken:5.2f} "
              f"fairseq{against_ct2}  same best as fairseq {same}/{len(subset)}  "
              f"BLEU {bleu:5.2f}")


if __name__ == "__main__":
    main()

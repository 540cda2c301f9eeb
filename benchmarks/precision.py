"""Decoding speed and quality in reduced precision: bfloat16 and float16 against float32.

Systems, run interleaved (``--repeats`` rounds, in each of which the systems decode every batch
in turn):

* ``fairseq fp32``: fairseq's fconv + fairseq's SequenceGenerator, float32 (the reference);
* ``ours fp32``: our convs2s (the same weights) + our generator, float32;
* ``ours bf16``: the same in bfloat16 (``--bf16``:
  beamplugin.fairseq_plugin.precision.cast_for_decoding);
* ``ours fp16``: the same in float16, cast directly (``--fp16 --cpu`` refuses it on a CPU
  without float16 products; it is timed here to back that choice).

Prints the median time per system, speed-ups against fairseq's and our float32 (the median of
each round's ratio), and how many best hypotheses equal our float32's. With ``--data`` and a
sentencepiece test set, it also decodes the whole ``--gen-subset`` in each of our precisions and
prints sacreBLEU and chrF against the references (``--ref``, raw text), as fairseq-generate with
``--post-process sentencepiece`` would give them.

``--products`` times the decoder's products alone instead (the 8000 x 256 vocabulary projection
and a 768 -> 512 convolution, weights not in cache): our float32 product (packed oneDNN), torch's
bfloat16 and float16 ``F.linear``, our int8 product (a scale per row), fbgemm's dynamic int8
linear (one scale for all rows: what --int8 used before, not batch invariant), and
``torch._weight_int8pack_mm`` (int8 weights, bfloat16 or float32 activations), as ratios to
float32.

    python -m benchmarks.precision --path CKPT.pt --data DATA-BIN --ref test.en \\
        --batch-sizes 1 64 --max-sentences 128
    python -m benchmarks.precision --random     # fconv_iwslt_de_en shape, 8k vocabulary
    python -m benchmarks.precision --products --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from argparse import Namespace
from collections.abc import Callable
from functools import partial

import sacrebleu
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

import beamplugin  # noqa: F401  (registers convs2s, safe checkpoint loading)
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.fairseq_plugin.precision import cast_for_decoding, native_on_cpu
from beamplugin.modules import int8_weights, packed_weights
from benchmarks import common
from benchmarks.common import cpu_description
from benchmarks.in_process import run
from benchmarks.models import benchmark_models, checkpoint_batches, prepare, random_batches

# the results files' names of the systems: float32 is "ours", as in every other table
SYSTEMS = {"fairseq fp32": "fairseq", "ours fp32": "ours"}


def parse_args() -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="an fconv or convs2s checkpoint")
    parser.add_argument("--data", help="binarized data dir of the checkpoint")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--ref", help="raw reference text of --gen-subset: BLEU and chrF")
    parser.add_argument("--random", action="store_true", help="random fconv_iwslt_de_en model")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="*", default=[1, 64], help="none: BLEU only"
    )
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-sentences", type=int, default=128, help="sentences timed")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16", "int8"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--products", action="store_true", help="time the products alone")
    common.add_results_option(parser)
    args = parser.parse_args()
    if not args.products and not args.random and not (args.path and args.data):
        parser.error("give --path and --data, or --random")
    return args


def in_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if precision == "fp16" and not native_on_cpu(torch.float16):
        return model.half()  # what --fp16 --cpu refuses: timed to show why
    cast_for_decoding([model], precision)
    return model


def time_products(args: Namespace) -> None:
    flush = torch.zeros(64 * 1024 * 1024 // 4)  # a step streams other weights in between

    def timed(product: Callable[[], torch.Tensor]) -> float:
        """Median of 10 products (a shared machine preempts some)."""
        product()
        times = []
        for _ in range(10):
            flush.add_(1.0)
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    print(f"# torch {torch.__version__}, {args.threads} threads, {cpu_description()}; median "
          "us per product, weights not in cache; (xN: float32 time / this time)")  # fmt: skip
    for out_features, in_features in [(8000, 256), (512, 768)]:
        weight = torch.randn(out_features, in_features) / in_features**0.5
        bias = torch.randn(out_features)
        packed = packed_weights.pack_weight(weight)
        int8 = int8_weights.pack_int8(weight, bias)
        int8_weight, scales = int8.values, int8.scales
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated
            warnings.simplefilter("ignore", UserWarning)
            zeros = torch.zeros(out_features, dtype=torch.long)
            fbgemm = torch.ops.quantized.linear_prepack(
                torch.quantize_per_channel(weight, scales.double(), zeros, 0, torch.qint8), bias
            )
        for rows in [1, 5, 40, 320]:
            x = torch.randn(rows, in_features)
            half = {dtype: (x.to(dtype), weight.to(dtype), bias.to(dtype))
                    for dtype in (torch.bfloat16, torch.float16)}  # fmt: skip
            xb, sb = half[torch.bfloat16][0], scales.bfloat16()
            products = {
                "float32 (ours)": partial(packed_weights.packed_product, x, packed, bias),
                "bf16 F.linear": partial(F.linear, *half[torch.bfloat16]),
                "fp16 F.linear": partial(F.linear, *half[torch.float16]),
                "int8 (ours)": partial(int8_weights.int8_linear, x, int8),
                "int8 fbgemm shared scale": partial(
                    torch.ops.quantized.linear_dynamic, x, fbgemm, True
                ),
                "int8pack_mm bf16": partial(torch._weight_int8pack_mm, xb, int8_weight, sb),
                "int8pack_mm fp32": partial(torch._weight_int8pack_mm, x, int8_weight, scales),
            }
            times: dict[str, list[float]] = {name: [] for name in products}
            for _ in range(args.repeats):
                for name, product in products.items():
                    times[name].append(timed(product))
            median = {name: statistics.median(t) for name, t in times.items()}
            base = median["float32 (ours)"]
            print(f"{out_features} x {in_features}, {rows:>3} rows: " + " | ".join(
                f"{name} {t:.0f} (x{base / t:.2f})" for name, t in median.items()
            ))  # fmt: skip


def paired(reference: list[float], times: list[float]) -> float:
    """The median over rounds of reference time / time: on a shared machine whose speed drifts
    between rounds, steadier than a ratio of medians."""
    return statistics.median(r / t for r, t in zip(reference, times, strict=True))


def best(outputs: list) -> list[list[int]]:
    return [hypos[0]["tokens"].tolist() for hypos in outputs]


def quality(systems: dict, task, args: Namespace) -> list[dict]:
    """sacreBLEU and chrF of each of our systems on the whole subset, and its records (row
    ``precision-quality``: BLEU, best hypotheses equal to our float32's)."""
    references = open(args.ref, encoding="utf-8").read().splitlines()
    batches = checkpoint_batches(task, args.gen_subset, len(references), 64)
    print(f"\n## quality: all {len(references)} sentences of {args.gen_subset}, batch 64")
    print("| system | BLEU | chrF | best hypotheses equal to fp32 |")
    print("| --- | --- | --- | --- |")
    reference_best = None
    records = []
    for name, (generator, model) in systems.items():
        if not name.startswith("ours"):
            continue
        _, outputs = run(generator, model, batches)
        ids = [int(i) for batch in batches for i in batch["id"]]
        hypotheses = [""] * len(references)
        for sentence_id, hypos in zip(ids, outputs, strict=True):
            text = task.target_dictionary.string(hypos[0]["tokens"], "sentencepiece")
            hypotheses[sentence_id] = text
        bleu = sacrebleu.corpus_bleu(hypotheses, [references])
        chrf = sacrebleu.corpus_chrf(hypotheses, [references])
        same = ""
        if reference_best is None:
            reference_best = best(outputs)
        else:
            equal = sum(a == b for a, b in zip(reference_best, best(outputs), strict=True))
            same = f"{equal}/{len(outputs)}"
        print(f"| {name} | {bleu.score:.2f} | {chrf.score:.2f} | {same} |")
        records.append(common.record(
            table=common.table_name(), row="precision-quality",
            what=f"our convs2s in reduced precisions: all {len(references)} sentences of "
                 f"{args.gen_subset}, batch 64, BLEU and best hypotheses equal to our float32's",
            system=SYSTEMS.get(name, name), model=args.path,
            precision=name.split()[-1], batch=64, bleu=bleu.score, chrf=chrf.score,
            same_as_float32=same or None, command=common.command_line(),
            **common.machine(threads=args.threads),
        ))  # fmt: skip
    return records


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.products:
        with torch.inference_mode():
            time_products(args)
        return
    fconv, convs2s, task, source = benchmark_models(args)
    dictionary = task.target_dictionary
    fconv, convs2s = prepare(fconv, args.beam), prepare(convs2s, args.beam)
    options = dict(beam_size=args.beam, max_len_b=200)
    systems = {
        "fairseq fp32": (FairseqGenerator([fconv], dictionary, **options), fconv),
        "ours fp32": (SequenceGenerator([convs2s], dictionary, **options), convs2s),
    }
    for precision in args.precisions:
        model = in_precision(convs2s, precision)
        systems[f"ours {precision}"] = (SequenceGenerator([model], dictionary, **options), model)
    native = {p: native_on_cpu(d) for p, d in [("bf16", torch.bfloat16), ("fp16", torch.float16)]}
    print(
        f"# {source}; beam {args.beam}, {args.threads} threads, torch {torch.__version__}\n"
        f"# {cpu_description()}, hardware products {native}, int8 weights of "
        f"{int8_weights.int8_weight_levels()} levels"
    )
    for batch_size in args.batch_sizes:
        if args.random:
            batches = random_batches(dictionary, args.max_sentences, batch_size, args.seed)
        else:
            batches = checkpoint_batches(task, args.gen_subset, args.max_sentences, batch_size)
        times: dict[str, list[float]] = {name: [] for name in systems}
        outputs = {name: run(gen, model, batches)[1] for name, (gen, model) in systems.items()}
        for _ in range(args.repeats):
            # the systems take turns batch by batch: a shared machine's speed drifts less
            # within a batch's turn than within a whole pass
            spent = dict.fromkeys(systems, 0.0)
            for batch in batches:
                for name, (generator, model) in systems.items():
                    spent[name] += run(generator, model, [batch])[0]
            for name, seconds in spent.items():
                times[name].append(seconds)
        sentences = sum(len(b["id"]) for b in batches)
        print(f"\n## batch size {batch_size}: {sentences} sentences, median of {args.repeats} "
              "rounds (ratios: median of each round's own ratio)")  # fmt: skip
        print("| system | sent/s | vs fairseq fp32 | vs ours fp32 | best equal to ours fp32 |")
        print("| --- | --- | --- | --- | --- |")
        median = {name: statistics.median(t) for name, t in times.items()}
        reference = best(outputs["ours fp32"])
        records = []
        for name in systems:
            equal = sum(a == b for a, b in zip(reference, best(outputs[name]), strict=True))
            against_ours = paired(times["ours fp32"], times[name])
            print(
                f"| {name} | {sentences / median[name]:.1f} | "
                f"x{paired(times['fairseq fp32'], times[name]):.2f} | "
                f"x{against_ours:.2f} | {equal}/{sentences} |"
            )
            records.append(common.record(
                table=common.table_name(), row=f"precision-b{batch_size}",
                what=f"our convs2s in reduced precisions ({source})",
                system=SYSTEMS.get(name, name), model=source,
                precision=name.split()[-1], batch=batch_size,
                sentences_per_s=sentences / median[name],
                ratio=None if name in SYSTEMS else {"against": "ours", "value": against_ours},
                same_as_ours_fp32=f"{equal}/{sentences}", command=common.command_line(),
                **common.machine(threads=args.threads),
            ))  # fmt: skip
        common.append_records(args.results, records)
    if args.ref and not args.random:
        common.append_records(args.results, quality(systems, task, args))


if __name__ == "__main__":
    main()

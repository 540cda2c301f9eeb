"""``--bf16`` on the CPU against float32 (and ``--int8``), side by side in one run.

Decoding: random models of the demo transformer's shape (3+3 layers x 256, feed-forward 1024, 4
heads, 8k words, shared output embedding: configs/transformer.conf), a base transformer's (6+6 x
512, feed-forward 2048, 8 heads, 32k words) and the demo ConvS2S's (convs2s_iwslt_de_en, 8k
words), each decoded by our generator (beam 5) in float32, with ``--bf16`` and with ``--int8``
(beamplugin.fairseq_plugin.precision.cast_for_decoding: its load-time trial included, so where
bfloat16 loses it decodes in float32 and shows x1.00). Every hypothesis is decoded to the same
length (min_len = max_len), so that each precision does the same work. Interleaved rounds: a
system's speed is its fastest round (other work on a shared machine only adds time), its ratio
to float32 the median of each round's own ratio (the two decoded seconds apart, so the
machine's drift over a run cancels). With one thread every time is the process's CPU time,
which a loaded machine's preemptions leave out (wall time otherwise).

Kernels: our float32 rows on bfloat16 weights (beamplugin.kernels.float_products.Bf16Weights)
against our float32 product and oneDNN's bfloat16 matmul (torch's, on its packed weight,
bfloat16 rows) at the transformers' shapes: microseconds a call, GFLOPS, and the share of one
core's bfloat16 peak (benchmarks/bf16_peak.c: independent chains of vdpbf16ps). On a CPU with
AMX, "ours bf16" is the kernel the process chose (beamplugin.kernels.bf16_kernels) and each of
our two kernels, AMX's tiles and AVX512-BF16's vdpbf16ps, is timed too (its share of the
vdpbf16ps peak, not of AMX's).

    python -m benchmarks.bf16 --threads 1 --results benchmarks/results/cpu-avx512.jsonl
    python -m benchmarks.bf16 --parts kernels       # make bench's bfloat16 kernel rows
    python -m benchmarks.bf16 --parts kernels --shapes 2048x512 --rows 5 64   # a few
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from argparse import Namespace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.transformer import TransformerModel

import beamplugin  # noqa: F401  (registers convs2s)
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.kernels import bf16_kernels, float_products, instruction_sets, native_library
from beamplugin.models.convs2s import ConvS2SModel
from beamplugin.modules import packed_weights
from beamplugin.runtime.heap import keep_freed_memory
from benchmarks import common

# (out, in): the demo transformer's fc1 and output projection, then a base transformer's
SHAPES = [(1024, 256), (8000, 256), (2048, 512), (32000, 512)]
ROWS = [1, 5, 64, 320]
MODELS = {
    "transformer demo 3+3x256": dict(layers=3, embed=256, ffn=1024, heads=4, words=8000),
    "transformer base 6+6x512": dict(layers=6, embed=512, ffn=2048, heads=8, words=32000),
    "convs2s demo": dict(words=8000),
}
PRECISIONS = ["float32", "bf16", "int8"]
SOURCE_LENGTH, TARGET_LENGTH = 20, 16
clock = time.perf_counter  # time.process_time with one thread (main)


def fastest(run: Any) -> float:
    """Microseconds a call (benchmarks.common.fastest, on :data:`clock`)."""
    return common.fastest(run, clock=clock)


def bf16_peak_gflops() -> float:
    """One core's vdpbf16ps peak: benchmarks/bf16_peak.c built as our kernels are for this CPU,
    the best of forty short runs (a few ms each: on a shared, loaded machine longer runs are
    all preempted somewhere); 0 where the CPU has no AVX512-BF16."""
    isa = instruction_sets.chosen()
    if isa is None or "avx512_bf16" not in instruction_sets.cpu_features():
        return 0.0
    library = native_library.cache_folder() / "bf16_peak.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    flags = [*native_library.FLAGS, *instruction_sets.build_flags(isa)]
    source = Path(__file__).with_name("bf16_peak.c")
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, *flags, "-o", str(library), str(source)], check=True)
    peak = ctypes.CDLL(str(library))
    peak.dpbf16_chains.argtypes = [ctypes.c_int64, ctypes.c_float]
    peak.dpbf16_chains.restype = ctypes.c_float
    steps, best = 200_000, 0.0
    for _ in range(40):
        start = clock()
        peak.dpbf16_chains(steps, 0.5)
        best = max(best, 64 * 12 * steps / (clock() - start) / 1e9)
    return best


def kernel_rows(peak: float, shapes: list[tuple[int, int]], counts: list[int]) -> list[dict]:
    """Each shape and row count: our bfloat16-weight product, our float32 one, oneDNN's
    bfloat16 matmul (microseconds a call), and each of our bfloat16 kernels where there are
    two (:func:`each_bf16_kernel`)."""
    rows = []
    kernels = each_bf16_kernel()
    for out, inner in shapes:
        weight = torch.randn(out, inner) / inner**0.5
        ours, float32 = float_products.pack_bf16_weights(weight), float_products.pack(weight)
        onednn = packed_weights.onednn_layout(weight.bfloat16())
        for count in counts:
            x = torch.randn(count, inner)
            flops = 2 * count * out * inner
            threads = native_library.threads_for(count * out * inner)
            times = {
                f"ours bf16 {name}": fastest(partial(bf16_kernels.call, kernel, x, ours.values,
                                                     None, None, out, False, threads))
                for name, kernel in kernels.items()
            }  # fmt: skip
            times |= {
                "ours bf16": fastest(partial(float_products.product, x, ours, None)),
                "ours float32": fastest(partial(float_products.product, x, float32, None)),
                "oneDNN bf16": fastest(
                    partial(packed_weights.packed_product, x.bfloat16(), onednn, None)
                ),
            }
            rows.append(dict(shape=(out, inner), rows=count, flops=flops, times=times,
                             share=flops / times["ours bf16"] / 1e3 / peak if peak else None))
    return rows


def each_bf16_kernel() -> dict[str, Any]:
    """Our bfloat16-weight kernels by name where this CPU runs more than one (AMX's and
    AVX512-BF16's), else none: "ours bf16" is the one kernel."""
    kernels = {name: bf16_kernels.named(name) for name in (bf16_kernels.AVX512_BF16,
                                                          bf16_kernels.AMX)}  # fmt: skip
    kernels = {name: kernel for name, kernel in kernels.items() if kernel is not None}
    return kernels if len(kernels) > 1 else {}


def shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` (--shapes)."""
    out, _, inner = text.partition("x")
    return int(out), int(inner)


def dictionary(words: int) -> Dictionary:
    d = Dictionary()
    for index in range(words - d.nspecial):
        d.add_symbol(f"w{index}")
    d.finalize(padding_factor=8)
    return d


def build(name: str, seed: int) -> tuple[torch.nn.Module, Dictionary]:
    """A random model of ``name``'s shape (:data:`MODELS`)."""
    shape = MODELS[name]
    d = dictionary(shape["words"])
    task = Namespace(source_dictionary=d, target_dictionary=d)
    torch.manual_seed(seed)
    if name.startswith("convs2s"):
        args = Namespace(max_source_positions=1024, max_target_positions=1024)
        ARCH_CONFIG_REGISTRY["convs2s_iwslt_de_en"](args)
        return ConvS2SModel.build_model(args, task).eval(), d
    args = Namespace(
        encoder_layers=shape["layers"], decoder_layers=shape["layers"],
        encoder_embed_dim=shape["embed"], decoder_embed_dim=shape["embed"],
        encoder_ffn_embed_dim=shape["ffn"], decoder_ffn_embed_dim=shape["ffn"],
        encoder_attention_heads=shape["heads"], decoder_attention_heads=shape["heads"],
        share_decoder_input_output_embed=True, dropout=0.0, max_source_positions=1024,
        max_target_positions=1024,
    )  # fmt: skip
    ARCH_CONFIG_REGISTRY["transformer"](args)
    return TransformerModel.build_model(args, task).eval(), d


def batches(d: Dictionary, sentences: int, batch: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for first in range(0, sentences, batch):
        n = min(batch, sentences - first)
        words = torch.randint(d.nspecial, len(d), (n, SOURCE_LENGTH), generator=g)
        tokens = torch.cat([words, torch.full((n, 1), d.eos())], 1)
        net_input = {"src_tokens": tokens, "src_lengths": torch.full((n,), SOURCE_LENGTH + 1)}
        out.append({"id": torch.arange(first, first + n), "net_input": net_input})
    return out


def decode_rows(names: list[str], sizes: list[int], repeats: int) -> list[dict]:
    """Sentences/s of each model, batch size and precision (the fastest of ``repeats``
    interleaved rounds)."""
    rows = []
    options = dict(beam_size=5, min_len=TARGET_LENGTH, max_len_b=TARGET_LENGTH)
    for name in names:
        model, d = build(name, seed=1)
        generators = {}
        for precision in PRECISIONS:
            copy = build(name, seed=1)[0]
            try:
                cast_for_decoding([copy], precision)
            except ValueError as error:  # --int8 without a weight large enough
                print(f"# {name}: {precision} skipped ({error})", file=sys.stderr)
                continue
            generators[precision] = SequenceGenerator([copy], d, **options)
        del model
        for batch in sizes:
            sentences = batch * 2 if batch > 1 else 8
            work = batches(d, sentences, batch, seed=2)
            times: dict[str, list[float]] = {p: [] for p in generators}
            with torch.inference_mode():
                for generator in generators.values():
                    generator.generate(None, work[0])  # warm: packing, first allocations
                for _ in range(repeats):
                    for precision, generator in generators.items():
                        start = clock()
                        for sample in work:
                            generator.generate(None, sample)
                        times[precision].append(clock() - start)
            speeds = {p: sentences / min(t) for p, t in times.items()}
            # each round's own ratio, its precisions seconds apart: the machine's drift over a
            # run (other work on a shared one) moved the fastest rounds' ratio by up to 0.1
            ratios = {p: statistics.median(f / o for f, o in zip(times["float32"], t, strict=True))
                      for p, t in times.items()}  # fmt: skip
            rows.append(dict(model=name, batch=batch, speeds=speeds, ratios=ratios))
            print(f"# {name}, batch {batch}: " + ", ".join(
                f"{p} {v:.1f} sent/s (x{ratios[p]:.2f})" for p, v in speeds.items()
            ), file=sys.stderr, flush=True)  # fmt: skip
    return rows


def machine(threads: int) -> dict[str, Any]:
    """benchmarks.common.machine, the kernels naming our bfloat16 one where it runs."""
    about = common.machine(threads=threads)
    chosen = bf16_kernels.chosen()
    if chosen is not None:
        about["kernels"] += f", bf16 {chosen[0]}"
    return about


def record(table: str, row: str, what: str, system: str, **fields: Any) -> dict:
    return common.record(table=table, row=row, what=what, system=system, **fields)


def records(kernels: list[dict], decodes: list[dict], args: Namespace) -> list[dict]:
    table = common.table_name()
    where = dict(machine(args.threads), command=common.command_line())
    out = []
    for k in kernels:
        out_f, in_f = k["shape"]
        row = f"bf16-kernel-{out_f}x{in_f}-{k['rows']}"
        what = f"bfloat16 product, {out_f} x {in_f} weight, {k['rows']} rows (batch: rows)"
        t = k["times"]
        out.append(record(table, row, what, "ours bf16", model="products", precision="bf16",
                          batch=k["rows"], us_per_call=round(t["ours bf16"], 1),
                          share_of_peak=None if k["share"] is None else round(k["share"], 3),
                          ratio={"against": "oneDNN bf16",
                                 "value": round(t["oneDNN bf16"] / t["ours bf16"], 2)},
                          **where))  # fmt: skip
        for system in [s for s in t if s != "ours bf16"]:
            precision = "bf16" if "bf16" in system else "float32"
            us = round(t[system], 1)
            out.append(record(table, row, what, system, model="products", precision=precision,
                              batch=k["rows"], us_per_call=us, **where))  # fmt: skip
    for d in decodes:
        slug = d["model"].split()[0] + "-" + d["model"].split()[1]
        row = f"bf16-{slug}-b{d['batch']}"
        what = f"{d['model']} (random weights), beam 5, batch {d['batch']}"
        for precision, speed in d["speeds"].items():
            ratio = None
            if precision != "float32":
                ratio = {"against": "ours", "value": round(d["ratios"][precision], 2)}
            # the README's names: "ours" (float32), "ours int8", and so "ours bf16"
            system = "ours" if precision == "float32" else f"ours {precision}"
            out.append(record(table, row, what, system, model=d["model"],
                              precision=precision, batch=d["batch"],
                              sentences_per_s=round(speed, 1), ratio=ratio, **where))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", nargs="+", default=["kernels", "decode"],
                        choices=["kernels", "decode"])  # fmt: skip
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--shapes", type=shape, nargs="+", default=SHAPES,
                        help="kernels' weights, OUTxIN (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="kernels' rows")
    common.add_results_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        global clock
        clock = time.process_time
    about = machine(args.threads)
    print(f"# torch {torch.__version__}, {common.cpu_description()}; {about['device']}; our "
          f"kernels {about['kernels']}; times: {clock.__name__}")  # fmt: skip
    if not float_products.bf16_weights_available():
        print("# no AVX512-BF16 here (or our kernels off): --bf16 decodes in float32")
    kernels: list[dict] = []
    # the heap as a decoding process sets it (the engine does): a 320-row output projection's
    # 41 MB of float32 logits served again, not mapped and faulted in at every call
    keep_freed_memory()
    if "kernels" in args.parts:
        peak = bf16_peak_gflops()
        print(f"# one core's bfloat16 peak (vdpbf16ps chains): {peak:.1f} GFLOPS")
        print(f"{'shape':>11}{'rows':>6}{'ours bf16 us':>14}{'GFLOPS':>8}{'% peak':>8}"
              f"{'oneDNN bf16 us':>16}{'x oneDNN':>9}{'f32 us':>9}{'x f32':>7}")  # fmt: skip
        with torch.inference_mode():
            kernels = kernel_rows(peak, args.shapes, args.rows)
        for k in kernels:
            t, rate = k["times"], k["flops"] / k["times"]["ours bf16"] / 1e3
            share = f"{100 * k['share']:7.0f}%" if k["share"] else f"{'':>8}"
            print(f"{'x'.join(map(str, k['shape'])):>11}{k['rows']:>6}{t['ours bf16']:14.1f}"
                  f"{rate:8.1f}{share}{t['oneDNN bf16']:16.1f}"
                  f"{t['oneDNN bf16'] / t['ours bf16']:9.2f}{t['ours float32']:9.1f}"
                  f"{t['ours float32'] / t['ours bf16']:7.2f}"
                  + "".join(f"  {s[10:]} {t[s]:.1f} us" for s in t if s.startswith("ours bf16 ")))
    decodes: list[dict] = []
    if "decode" in args.parts:
        decodes = decode_rows(args.models, args.batch_sizes, args.repeats)
        print(f"{'model':<26}{'batch':>6}" + "".join(f"{p:>16}" for p in PRECISIONS))
        for d in decodes:
            cells = "".join(
                f"{d['speeds'][p]:8.1f} (x{d['ratios'][p]:.2f})" if p in d["speeds"]
                else f"{'-':>16}" for p in PRECISIONS
            )  # fmt: skip
            print(f"{d['model']:<26}{d['batch']:>6}{cells}")
    common.append_records(args.results, records(kernels, decodes, args))


if __name__ == "__main__":
    main()

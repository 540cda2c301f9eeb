"""Our kernels against torch's, per kernel and shape, on each instruction set this CPU runs.

For each set (``--sets``; default: every set this CPU runs, AVX2 on an AVX-512 machine too), a
process of its own pins it (``BEAMPLUGIN_ISA``) and times, in interleaved rounds, each of our
kernels and the path torch takes without it at a model's shapes: float32 products (oneDNN's on
its packed weight), int8 products (``torch._int_mm`` and the scaling), a decoder step's two
attentions (batched products and softmax), a beam step's candidates (add and topk), layer norms.
Prints microseconds a call (the fastest round), ours against torch's, GFLOPS (GOPS for int8),
and the share of the set's multiply-add peak of one core, measured by ``benchmarks/fma_peak.c``
built for the set (independent chains of fused multiply-adds on its vectors). In the AVX2
process torch's kernels are held to AVX2 too (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``),
as on a CPU without AVX-512. ``--results FILE`` appends a record a row (table ``cpu-SET``).

``--kernels paths`` (not in the default set) times every path a float32 product can take, which
backs the choice in beamplugin/modules/packed_weights.py: ``F.linear`` (MKL), oneDNN's matmul on the
plain weight and on its packed one, and our kernel on its panels, at the decoder's product
shapes; the median microseconds a product over interleaved rounds, "hot" and "cold" (64 MiB
streamed through the caches before each product, as a decoder step does between two uses of
the same weight).

    python -m benchmarks.kernels --threads 1
    python -m benchmarks.kernels --sets avx2 --threads 1 --kernels products
    python -m benchmarks.kernels --kernels paths --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from beamplugin.kernels import (
    candidates,
    float_attention,
    float_products,
    instruction_sets,
    int8_products,
    native_library,
)
from beamplugin.modules import int8_weights, packed_weights
from benchmarks.common import (
    add_results_option,
    append_records,
    command_line,
    cpu_description,
    fastest,
    in_own_process,
    machine,
    record,
)

# (out, in) of a 3+3 x 256 transformer's products and its 3952-word output projection, and of
# a base transformer's (512 wide, feed-forward 2048, 32k vocabulary)
PRODUCT_SHAPES = [(256, 256), (768, 256), (1024, 256), (256, 1024), (3952, 256),
                  (512, 512), (2048, 512), (512, 2048), (32000, 512)]  # fmt: skip
ROWS = [1, 5, 80, 320]  # greedy at batch 1, beam 5 at batch 1, 16 and 64
KERNELS = ["products", "int8", "attention", "candidates", "norm"]
# (out, in) of the paths' table: vocabulary projections, a convs2s convolution, a transformer's
# attention and feed-forward products; rows: greedy, beam 5, batches of 8 and 64
PATH_SHAPES = [(8000, 256), (32000, 512), (512, 768), (256, 256), (1024, 256), (256, 1024)]
PATH_ROWS = [1, 5, 40, 320]
# what our kernel of each kind is set against
TORCH_PATHS = {"products": "torch (oneDNN)", "int8": "torch (int8_mm)",
               "attention": "torch (bmm, softmax)", "candidates": "torch (add, topk)",
               "norm": "torch (layer_norm)"}  # fmt: skip
# torch's own kernels held to the same set, as on a CPU without more (oneDNN and ATen pick theirs
# at run time, as we do)
TORCH_CAPPED = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def peak_gflops(isa: instruction_sets.InstructionSet) -> float:
    """One core's multiply-add peak on ``isa``: benchmarks/fma_peak.c built for it, the best of
    nine runs (this machine is shared: other work only ever slows a run)."""
    library = native_library.cache_folder() / f"fma_peak-{isa.name}.so"
    compiler = os.environ.get("CC", "cc")
    flags = [*native_library.FLAGS, *instruction_sets.build_flags(isa)]
    source = Path(__file__).with_name("fma_peak.c")
    library.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([compiler, *flags, f"-I{native_library.SOURCES}", "-o", str(library),
                    str(source)], check=True)  # fmt: skip
    peak = ctypes.CDLL(str(library))
    peak.fma_chains.argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.c_float]
    peak.fma_chains.restype = ctypes.c_float
    steps, best = 5_000_000, 0.0
    for _ in range(9):
        start = time.perf_counter()
        peak.fma_chains(steps, 0.999, 0.001)
        best = max(best, 2 * 12 * peak.lanes() * steps / (time.perf_counter() - start) / 1e9)
    return best


def product_rows(shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for out, inner in shapes:
        weight = torch.randn(out, inner)
        ours, theirs = float_products.pack(weight), packed_weights.onednn_layout(weight)
        plain = int8_weights.quantize_int8(weight, None)  # torch's int8 path's weight
        int8 = None  # ours: the same values in our kernel's panels
        if int8_products.available():
            int8 = int8_weights.in_panels(plain)
        for count in ROWS:
            x = torch.randn(count, inner)
            flops = 2 * count * out * inner
            rows.append(dict(
                kernel="products", shape=f"{out}x{inner}", rows=count, flops=flops,
                ours=fastest(partial(float_products.product, x, ours, None)),
                torch=fastest(partial(packed_weights.packed_product, x, theirs, None)),
            ))  # fmt: skip
            if int8 is not None:
                rows.append(dict(
                    kernel="int8", shape=f"{out}x{inner}", rows=count, flops=flops,
                    ours=fastest(partial(int8_weights.int8_linear, x, int8)),
                    torch=fastest(partial(int8_weights.int8_linear, x, plain)),
                ))  # fmt: skip
    return rows


def attention_rows() -> list[dict]:
    rows = []
    for heads, head_dim in [(4, 64), (8, 64)]:
        for count in (5, 320):
            trial = float_attention.trial(heads, head_dim, rows=count)
            # two attentions: 16 history columns and 24 source positions, q.k and p.v each
            flops = 2 * 2 * count * heads * head_dim * (16 + 24)
            rows.append(dict(kernel="attention", shape=f"{heads}x{head_dim}", rows=count,
                             flops=flops, ours=fastest(trial.ours),
                             torch=fastest(trial.torchs)))  # fmt: skip
    return rows


def candidate_rows() -> list[dict]:
    rows = []
    for vocab in (3952, 32000):
        trial = candidates.trial(5, vocab)
        for args in trial.inputs:
            rows.append(dict(kernel="candidates", shape=f"5x{vocab}", rows=args[0].size(0),
                             flops=0, ours=fastest(partial(trial.ours, *args)),
                             torch=fastest(partial(trial.torchs, *args))))  # fmt: skip
    return rows


def norm_rows() -> list[dict]:
    rows = []
    for width in (256, 512):
        weight, bias = torch.randn(width), torch.randn(width)
        for count in (5, 320):
            x = torch.randn(count, width)
            rows.append(dict(
                kernel="norm", shape=f"{width}", rows=count, flops=0,
                ours=fastest(partial(float_products.layer_norm, x, weight, bias, 1e-5)),
                torch=fastest(partial(F.layer_norm, x, (width,), weight, bias, 1e-5)),
            ))  # fmt: skip
    return rows


def timed(product: Callable[[], object], flush: torch.Tensor | None, calls: int) -> float:
    """Mean microseconds of ``calls`` products, the caches flushed before each by a pass over
    ``flush`` (None: hot)."""
    total = 0.0
    for _ in range(calls):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        product()
        total += time.perf_counter() - start
    return total / calls * 1e6


def path_rows(shapes: list[tuple[int, int]], rounds: int, calls: int) -> list[dict]:
    """A float32 product's every path, hot and cold, the median of ``rounds`` interleaved
    rounds of ``calls`` products: the paths' table."""
    onednn, onednn_pack = packed_weights._onednn_linear, packed_weights._onednn_pack
    if onednn is None or onednn_pack is None:
        raise SystemExit("this torch build has no oneDNN linear")
    flush = torch.zeros(64 * 1024 * 1024 // 4)
    rows = []
    for out, inner in shapes:
        weight = torch.randn(out, inner) / inner**0.5
        bias = torch.randn(out)
        packed, panels = onednn_pack(weight, None), float_products.pack(weight)
        for count in PATH_ROWS:
            x = torch.randn(count, inner)
            products = {
                "F.linear": partial(F.linear, x, weight, bias),
                "oneDNN": partial(onednn, x, weight, bias, "none", [], ""),
                "packed": partial(onednn, x, packed, bias, "none", [], ""),
                "ours": partial(float_products.product, x, panels, bias),
            }
            for cache, flushing in (("hot", None), ("cold", flush)):
                times: dict[str, list[float]] = {name: [] for name in products}
                for _ in range(rounds):
                    for name, product in products.items():
                        product()  # warm-up (and oneDNN's primitive cache)
                        times[name].append(timed(product, flushing, calls))
                rows.append(dict(kernel="paths", shape=f"{out}x{inner}", rows=count, cache=cache,
                                 paths={n: statistics.median(ts) for n, ts in times.items()}))
    return rows


def measure(args: argparse.Namespace, shapes: list[tuple[int, int]] | None) -> dict:
    """This process's set: its peak and the rows of every kernel in ``args.kernels``."""
    kernels = args.kernels
    isa = instruction_sets.chosen()
    assert isa is not None, "pin a set with BEAMPLUGIN_ISA"
    rows: list[dict] = []
    with torch.no_grad():
        if "products" in kernels or "int8" in kernels:
            rows += [r for r in product_rows(shapes or PRODUCT_SHAPES) if r["kernel"] in kernels]
        if "attention" in kernels:
            rows += attention_rows()
        if "candidates" in kernels:
            rows += candidate_rows()
        if "norm" in kernels:
            rows += norm_rows()
        if "paths" in kernels:
            rows += path_rows(shapes or PATH_SHAPES, args.rounds, args.calls)
    variant = f"{native_library.built_for('products')}, int8 "
    variant += native_library.built_for("int8_products")
    torchs = f"capability {torch.backends.cpu.get_cpu_capability()}, oneDNN "
    torchs += os.environ.get("ONEDNN_MAX_CPU_ISA", "uncapped")
    return dict(set=isa.name, variant=variant, torch=torchs, peak=peak_gflops(isa), rows=rows)


def print_table(results: list[dict], threads: int) -> None:
    print(f"# torch {torch.__version__}, {threads} thread(s), {cpu_description()}")
    for result in results:
        print(f"# {result['set']}: our kernels {result['variant']}; torch's {result['torch']}; "
              f"one core's multiply-add peak {result['peak']:.1f} GFLOPS (benchmarks/fma_peak.c)")
    by_key: dict[tuple, list[tuple[dict, dict]]] = {}
    for result in results:
        for row in result["rows"]:
            key = (row["kernel"], row["shape"], row["rows"], row.get("cache"))
            by_key.setdefault(key, []).append((result, row))
    kernels = {key: entries for key, entries in by_key.items() if key[0] != "paths"}
    if kernels:
        print(f"{'kernel':<11}{'shape':>11}{'rows':>6}  {'set':<8}{'ours us':>10}{'torch us':>10}"
              f"{'x torch':>9}{'GFLOPS':>9}{'% peak':>8}")  # fmt: skip
    for (kernel, shape, count, _), entries in kernels.items():
        for result, row in entries:
            rate = row["flops"] / row["ours"] / 1e3 if row["flops"] else 0.0
            share = f"{100 * rate / threads / result['peak']:7.0f}%" if rate else f"{'':>8}"
            rate_text = f"{rate:9.1f}" if rate else f"{'':>9}"
            print(f"{kernel:<11}{shape:>11}{count:>6}  {result['set']:<8}{row['ours']:10.1f}"
                  f"{row['torch']:10.1f}{row['torch'] / row['ours']:9.2f}{rate_text}{share}")
    paths = {key: entries for key, entries in by_key.items() if key[0] == "paths"}
    if paths:
        print("\n# a float32 product's paths: median us a product; cold: 64 MiB through the "
              "caches before each")
        print(f"{'shape':>11}{'rows':>6} {'cache':>5}  {'set':<8}{'F.linear':>9}{'oneDNN':>9}"
              f"{'packed':>9}{'ours':>9}{'packed/ours':>12}")  # fmt: skip
    for (_, shape, count, cache), entries in paths.items():
        for result, row in entries:
            times = row["paths"]
            print(f"{shape:>11}{count:>6} {cache:>5}  {result['set']:<8}"
                  + "".join(f"{times[name]:9.1f}" for name in ("F.linear", "oneDNN", "packed",
                                                               "ours"))
                  + f"{times['packed'] / times['ours']:12.2f}")  # fmt: skip


def records(results: list[dict], threads: int) -> list[dict]:
    """A record a row of ours against torch's (the paths' rows: ours against oneDNN's packed
    product), in the table of its set."""
    command, where = command_line(), machine(threads=threads)
    out = []
    for result in results:
        for row in result["rows"]:
            paths = row["kernel"] == "paths"
            ours = row["paths"]["ours"] if paths else row["ours"]
            theirs = row["paths"]["packed"] if paths else row["torch"]
            kind = "float32 product" if row["kernel"] in ("products", "paths") else row["kernel"]
            cache = f", {row['cache']} caches" if paths else ""
            shape = row["shape"].replace("x", " x ")
            shape += " weight" if row["kernel"] in ("products", "int8", "paths") else ""
            rate = row["flops"] / ours / 1e3 if row.get("flops") else None
            out.append(record(
                table=f"cpu-{result['set']}", system="ours", model=row["kernel"],
                row=f"kernel-{'' if row['kernel'] == 'products' else row['kernel'] + '-'}"
                    f"{row['shape']}-{row['rows']}{'-' + row['cache'] if paths else ''}",
                what=f"our {kind}, {shape}, {row['rows']} "
                     f"row{'s' if row['rows'] > 1 else ''}{cache} (batch: rows)",
                precision="int8" if row["kernel"] == "int8" else "float32", batch=row["rows"],
                ratio={"against": "torch (oneDNN packed)" if paths else TORCH_PATHS[row["kernel"]],
                       "value": round(theirs / ours, 2)},
                us_per_call=round(ours, 1), command=command,
                share_of_peak=None if rate is None else round(rate / threads / result["peak"], 2),
                **{**where, "kernels": result["variant"]},
            ))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs_here = [isa.name for isa in instruction_sets.SETS[:-1] if instruction_sets.runs_here(isa)]
    parser.add_argument("--sets", nargs="+", default=runs_here, help=f"default: {runs_here}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernels", nargs="+", default=KERNELS, choices=[*KERNELS, "paths"])
    parser.add_argument("--shapes", nargs="+", default=None, help="products' OUTxIN shapes")
    parser.add_argument("--rounds", type=int, default=3, help="paths: interleaved rounds")
    parser.add_argument("--calls", type=int, default=40, help="paths: products timed a round")
    add_results_option(parser)
    parser.add_argument("--json", action="store_true", help="(internal) measure this process's set")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = None
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    if args.json:
        print(json.dumps(measure(args, shapes)))
        return
    results = []
    for name in args.sets:
        env = {instruction_sets.CHOICE: name, **TORCH_CAPPED.get(name, {})}
        lines = in_own_process(__spec__.name, "--json", *sys.argv[1:], env=env)
        results.append(json.loads(lines[-1]))
    print_table(results, args.threads)
    append_records(args.results, records(results, args.threads))


if __name__ == "__main__":
    main()

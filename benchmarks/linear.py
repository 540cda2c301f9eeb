"""Time F.linear (MKL on CPU) against oneDNN's matmul (given the plain weight or its packed one)
and against our kernel on its panels (beamplugin/kernels/float_products.py), for the decoder's
product shapes.

Backs the choice in beamplugin/modules/linear.py. Runs interleaved rounds and prints the median
microseconds per product and the ratio; "cold" first streams 64 MiB through the caches, as a
decoder step does between two uses of the same weight.

    python -m benchmarks.linear --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from beamplugin.kernels import float_products
from beamplugin.modules import linear as linear_module
from benchmarks.common import cpu_description

# (out, in) features: vocabulary projections, a convs2s convolution, a transformer's attention
# and feed-forward products
SHAPES = [(8000, 256), (32000, 512), (512, 768), (256, 256), (1024, 256), (256, 1024)]
ROWS = [1, 5, 40, 320]


def timed(product: Callable[[], torch.Tensor], flush: torch.Tensor | None, n: int) -> float:
    total = 0.0
    for _ in range(n):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        product()
        total += time.perf_counter() - start
    return total / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="products timed per round")
    args = parser.parse_args()
    onednn, onednn_pack = linear_module._onednn_linear, linear_module._onednn_pack
    if onednn is None or onednn_pack is None:
        raise SystemExit("this torch build has no oneDNN linear")
    if not float_products.available():
        raise SystemExit("our kernel cannot be built here (see the log)")
    torch.set_num_threads(args.threads)
    flush = torch.zeros(64 * 1024 * 1024 // 4)
    print(f"# torch {torch.__version__}, {args.threads} threads, {cpu_description()}; median us "
          "per product")  # fmt: skip
    print(
        f"{'out x in':>12} {'rows':>5} {'cache':>5} {'F.linear':>9} {'oneDNN':>9} "
        f"{'packed':>9} {'ours':>9} {'packed/ours':>12}"
    )
    with torch.no_grad():
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features) / in_features**0.5
            bias = torch.randn(out_features)
            packed, panels = onednn_pack(weight, None), float_products.pack(weight)
            for rows in ROWS:
                x = torch.randn(rows, in_features)
                products = {
                    "mkl": lambda x=x, w=weight, b=bias: F.linear(x, w, b),
                    "onednn": lambda x=x, w=weight, b=bias: onednn(x, w, b, "none", [], ""),
                    "packed": lambda x=x, w=packed, b=bias: onednn(x, w, b, "none", [], ""),
                    "ours": lambda x=x, w=panels, b=bias: float_products.product(x, w, b),
                }
                for cache, flushing in (("hot", None), ("cold", flush)):
                    times: dict[str, list[float]] = {name: [] for name in products}
                    for _ in range(args.rounds):
                        for name, product in products.items():
                            product()  # warm-up (and oneDNN's primitive cache)
                            times[name].append(timed(product, flushing, args.calls))
                    mkl, dnn, pack, ours = (statistics.median(times[n]) for n in products)
                    print(
                        f"{out_features:>6} x {in_features:<4} {rows:>5} {cache:>5} "
                        f"{mkl:9.1f} {dnn:9.1f} {pack:9.1f} {ours:9.1f} {pack / ours:12.2f}"
                    )


if __name__ == "__main__":
    main()

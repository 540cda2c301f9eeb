"""How far a decode is from what its matrix products alone take on this CPU (a roofline).

For each batch size, our convs2s and generator decode the sentences once while every matrix
product is recorded: the module that makes it, its weight and its row count (decoder steps
have as many rows as beams in flight), the attention's per-sentence products with their
source widths, the encoder's convolutions. Their floating-point work is counted from those
shapes (2 x rows x in x out per product) and split by part of the model: vocabulary
projection, decoder convolutions, attention (scores and context), projections (fc1, fc2,
attention in/out), encoder.

Then, in interleaved rounds (``--repeats``), the decode is timed against the same products
alone: every recorded product replayed in order, same kernels (packed oneDNN weights, int8
under ``--precision int8``), same shapes, row counts and weights, on random inputs. The ratio of
the two times is the share of its products-only bound the decode reaches. What takes the rest
is shown by a separate instrumented pass: the products inside the decode (the attention's with
its softmax), the forwards' other work (embeddings, GLU, residuals), the state reorders and the
search's bookkeeping.

    python -m benchmarks.roofline --random --batch-sizes 1 64
    python -m benchmarks.roofline --path CKPT.pt --data DATA-BIN --precision int8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import beamplugin.modules.attention as attention_module
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.fairseq_plugin.precision import PRECISIONS, cast_for_decoding
from beamplugin.modules.inference_cache import InferenceCache
from benchmarks import common
from benchmarks.common import cpu_description
from benchmarks.in_process import Timers, instrument, replace, run
from benchmarks.models import benchmark_models, checkpoint_batches, prepare, random_batches

PARTS = ["vocabulary", "decoder convolutions", "attention", "projections", "encoder"]


def parse_args() -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="an fconv or convs2s checkpoint")
    parser.add_argument("--data", help="binarized data dir of the checkpoint")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--random", action="store_true", help="random fconv_iwslt_de_en model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-sentences", type=int, nargs="+", default=[16, 64],
        help="sentences decoded, per batch size (the last one for further sizes)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--precision", default="float32", choices=sorted(PRECISIONS))
    parser.add_argument("--seed", type=int, default=1)
    common.add_results_option(parser)
    args = parser.parse_args()
    if not args.random and not (args.path and args.data):
        parser.error("give --path and --data, or --random")
    return args


@dataclass
class Recording:
    """The products of one decode, in order: (part, replay function, floating-point work)."""

    products: list[tuple[str, Callable[[], Any], int]] = field(default_factory=list)
    inputs: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def random(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A random input of ``shape``, one per shape (the values do not change the time)."""
        key = (tuple(shape), dtype)
        if key not in self.inputs:
            self.inputs[key] = torch.randn(shape).to(dtype)
        return self.inputs[key]

    def work(self) -> dict[str, int]:
        totals = dict.fromkeys(PARTS, 0)
        for part, _, flops in self.products:
            totals[part] += flops
        return totals

    def replay(self) -> float:
        start = time.perf_counter()
        for _, product, _ in self.products:
            product()
        return time.perf_counter() - start


def part_of(name: str) -> str:
    """The part of the model a module (by its name in the model) belongs to."""
    if name.startswith("encoder."):
        return "encoder"
    if name == "decoder.fc3":
        return "vocabulary"
    if name.startswith("decoder.convolutions."):
        return "decoder convolutions"
    return "projections"


def record(generator: Any, model: torch.nn.Module, batches: list) -> Recording:
    """Decode ``batches`` once, recording every matrix product."""
    recording = Recording()
    names = {module: name for name, module in model.named_modules()}
    product = InferenceCache.product
    attend = attention_module._attend

    def recorded_product(
        module: InferenceCache, x: torch.Tensor, weight: torch.Tensor, *rest: Any
    ) -> torch.Tensor:
        x_alone = recording.random(x.shape, x.dtype)
        replay = lambda: product(module, x_alone, weight, *rest)  # noqa: E731
        flops = 2 * x[..., 0].numel() * weight.numel()
        recording.products.append((part_of(names[module]), replay, flops))
        return product(module, x, weight, *rest)

    def recorded_attend(query: torch.Tensor, memory: dict, out: Any = None) -> Any:
        keys, values, bias = memory["keys"], memory["values"], memory["bias"]
        sentences, embed, width = keys.shape
        q = recording.random(torch.Size((sentences, query.numel() // sentences // embed, embed)),
                             query.dtype)  # fmt: skip
        weights = recording.random(torch.Size((q.size(0), q.size(1), width)), query.dtype)

        def replay() -> None:  # the two products of the attention, without the softmax
            torch.bmm(q, keys) if bias is None else torch.baddbmm(bias, q, keys)
            torch.bmm(weights, values)

        recording.products.append(("attention", replay, 2 * 2 * q.numel() * width))
        return attend(query, memory, out)

    restore = [
        replace(InferenceCache, "product", recorded_product),
        replace(attention_module, "_attend", recorded_attend),
    ]
    try:
        run(generator, model, batches)
    finally:
        for undo in restore:
            undo()
    return recording


def where_the_time_goes(generator: Any, model: torch.nn.Module, batches: list) -> dict[str, float]:
    """Seconds of an instrumented pass by part: the products (the attention's with its
    softmax), the rest of the forwards, state and encoder reorders, the search's bookkeeping;
    and "total"."""
    timers = Timers(torch.device("cpu"))
    restore = instrument(generator, timers) + [
        timers.wrap(InferenceCache, "product", "products"),
        timers.wrap(attention_module, "_attend", "products"),
    ]
    total = run(generator, model, batches)[0]
    for undo in restore:
        undo()
    seconds = timers.seconds
    forward, reorder = seconds.get("forward", 0.0), seconds.get("reorder", 0.0)
    return {
        "products (the attention's with its softmax)": seconds["products"],
        "forwards besides products (embeddings, GLU, residuals, states, quantization)": forward
        - seconds["products"],
        "state and encoder reorders": reorder,
        "search bookkeeping (log-softmax, candidates, stop checks, finished hypotheses)": total
        - forward
        - reorder,
        "total": total,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    _, convs2s, task, source = benchmark_models(args)
    model = prepare(convs2s, args.beam)
    if args.precision != "float32":
        model = copy.deepcopy(model)
        cast_for_decoding([model], args.precision)
    dictionary = task.target_dictionary
    generator = SequenceGenerator([model], dictionary, beam_size=args.beam, max_len_b=200)
    print(f"# {source}; our convs2s in {args.precision}, beam {args.beam}, {args.threads} "
          f"threads, torch {torch.__version__}\n# {cpu_description()}")  # fmt: skip
    for index, batch_size in enumerate(args.batch_sizes):
        n = args.max_sentences[min(index, len(args.max_sentences) - 1)]
        if args.random:
            batches = random_batches(dictionary, n, batch_size, args.seed)
        else:
            batches = checkpoint_batches(task, args.gen_subset, n, batch_size)
        with torch.inference_mode():
            recording = record(generator, model, batches)
            recording.replay()  # warm-up
            decode, alone = [], []
            for _ in range(args.repeats):
                decode.append(run(generator, model, batches)[0])
                alone.append(recording.replay())
            t_decode, t_alone = statistics.median(decode), statistics.median(alone)
            split = where_the_time_goes(generator, model, batches)
        total = split.pop("total")
        work = recording.work()
        flops = sum(work.values())
        print(f"\n## batch size {batch_size}: {n} sentences, {len(recording.products)} products, "
              f"{flops / 1e9:.2f} GFLOP (median of {args.repeats} interleaved rounds)")  # fmt: skip
        print("work: " + ", ".join(f"{part} {100 * w / flops:.0f}%" for part, w in work.items()))
        print(f"decode {t_decode:.3f} s ({flops / t_decode / 1e9:.1f} GFLOP/s); the same products "
              f"alone {t_alone:.3f} s ({flops / t_alone / 1e9:.1f} GFLOP/s)")  # fmt: skip
        print(f"the decode runs at {100 * t_alone / t_decode:.0f}% of its products-only bound")
        print(f"where a decode's time goes (instrumented pass, {total:.3f} s):")
        for part, seconds in split.items():
            print(f"  {100 * seconds / total:5.1f}%  {part}")
        common.append_records(args.results, [common.record(
            table=common.table_name(), row=f"roofline-{args.precision}-b{batch_size}",
            what=f"our convs2s ({source}) against its products alone", system="ours",
            model=source, precision=args.precision, batch=batch_size, sentences_per_s=n / t_decode,
            ratio={"against": "its products alone", "value": t_alone / t_decode},
            gflops_per_s=flops / t_decode / 1e9, command=common.command_line(),
            **common.machine(threads=args.threads),
        )])  # fmt: skip


if __name__ == "__main__":
    main()

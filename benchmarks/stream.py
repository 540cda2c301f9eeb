"""Throughput of a stream of sentences: continuous batching against batch after batch.

The sentences of a test set arrive in random order (a stream cannot sort them). For each
capacity C (sentences in flight), in interleaved rounds:

* ``continuous``: our engine, new sentences joining as others finish (beamplugin.streams);
* ``static``: our generator on batches of C sentences in arrival order (what decoding a stream
  batch after batch gives);
* ``static, sorted``: the same sentences sorted by length into batches of C (what
  fairseq-generate does offline, and a stream cannot);
* ``continuous, sorted``: the engine on the sorted sentences;
* ``fairseq``: fairseq's SequenceGenerator on the arrival-order batches (same model).

Every system decodes once untimed first; each round runs the systems in an order of its own
(shuffled, seeded). Before each decode, Python's cyclic garbage collector collects and freezes
what exists (untimed): a full pass walks every object of the process (300,000 and more: the
libraries, the model, the outputs kept for comparison; 0.15-0.3 s) at moments set by allocation
counts, so it charged one decode or another at random, a few percent of it. Prints sentences/s
(median wall time over the rounds, and CPU time of this process), each system's speed against
``static`` and ``static, sorted``, the same ratios paired within rounds (the median of each
round's ratio: the machine's speed drifts by several percent over minutes, and a round's
systems run within a minute of each other), and whether every sentence's best hypothesis is the
same as continuous's.

    python -m benchmarks.stream --path data/work/checkpoints/checkpoint_last.pt \\
        --data data/work/bin --sentences 1000 --capacities 16 64
    python -m benchmarks.stream --path CKPT --data DATA-BIN --precision int8   # or bf16
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from fairseq import checkpoint_utils
from fairseq.data import data_utils
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

import beamplugin  # noqa: F401  (registers the task and model, safe checkpoint loading)
from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin.precision import PRECISIONS, cast_for_decoding
from beamplugin.streams import translate
from benchmarks import common
from benchmarks.common import cpu_description

Hypotheses = list[dict]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="a convs2s checkpoint")
    parser.add_argument("--data", required=True, help="its binarized data directory")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--capacities", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=1, help="of the arrival order")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="float32", choices=sorted(PRECISIONS),
                        help="what every system decodes in (cast_for_decoding)")  # fmt: skip
    common.add_results_option(parser)
    return parser.parse_args()


def batches(sentences: list[torch.Tensor], size: int, pad: int, eos: int) -> list[dict]:
    out = []
    for start in range(0, len(sentences), size):
        chunk = sentences[start : start + size]
        tokens = data_utils.collate_tokens(chunk, pad, eos, left_pad=True)
        lengths = torch.tensor([len(s) for s in chunk], device=tokens.device)
        out.append({"net_input": {"src_tokens": tokens, "src_lengths": lengths}})
    return out


def stream(
    generator: SequenceGenerator, sentences: list[torch.Tensor], order: list[int], capacity: int
) -> list[Hypotheses]:
    """Hypotheses of each sentence, decoded as a stream in ``order``."""
    out: list[Hypotheses] = [[] for _ in sentences]
    for index, hypos in translate(generator, (sentences[i] for i in order), capacity):
        out[order[index]] = hypos
    return out


def static(
    model: torch.nn.Module, generator: object, batched: list[dict], order: list[int]
) -> list[Hypotheses]:
    """Hypotheses of each sentence, decoded batch after batch (``order``: the sentence of each
    row of the batches, in turn)."""
    out: list[Hypotheses] = [[] for _ in order]
    results = [h for batch in batched for h in generator.generate([model], batch)]
    for index, hypos in zip(order, results, strict=True):
        out[index] = hypos
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    model = models[0].to(device).eval()
    cfg.generation.beam = args.beam
    model.prepare_for_inference_(cfg)
    cast_for_decoding([model], args.precision)
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    dictionary = task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    count = min(args.sentences, len(dataset))
    arrival = [dataset[i]["source"].to(device) for i in range(count)]
    random.Random(args.seed).shuffle(arrival)
    by_length = sorted(range(count), key=lambda i: len(arrival[i]))
    ours = SequenceGenerator([model], dictionary, beam_size=args.beam)
    theirs = FairseqGenerator([model], dictionary, beam_size=args.beam)

    print(f"{count} sentences of {args.gen_subset} in random order, beam {args.beam}, "
          f"{args.threads} threads, {args.device}, {args.precision}, median of {args.repeats} "
          f"rounds; {cpu_description()}")  # fmt: skip
    for capacity in args.capacities:
        static_arrival = batches(arrival, capacity, pad, eos)
        static_sorted = batches([arrival[i] for i in by_length], capacity, pad, eos)

        arrival_order = list(range(count))
        systems: dict[str, Callable[[], list[Hypotheses]]] = {
            "continuous": partial(stream, ours, arrival, arrival_order, capacity),
            "static": partial(static, model, ours, static_arrival, arrival_order),
            "static, sorted": partial(static, model, ours, static_sorted, by_length),
            "continuous, sorted": partial(stream, ours, arrival, by_length, capacity),
            "fairseq": partial(static, model, theirs, static_arrival, arrival_order),
        }
        wall: dict[str, list[float]] = {name: [] for name in systems}
        cpu: dict[str, list[float]] = {name: [] for name in systems}
        outputs: dict[str, list[Hypotheses]] = {}
        # Untimed first: the first decode in a process pays the allocator's page faults (a
        # second of system time at capacity 64), whichever system runs first.
        for decode in systems.values():
            decode()
        shuffle = random.Random(args.seed)
        for _ in range(args.repeats):
            # no system always runs right after another (fairseq's generator leaves the heap
            # and caches in a state of its own; a cyclic rotation keeps each one's predecessor)
            for name in shuffle.sample(list(systems), len(systems)):
                decode = systems[name]
                gc.collect()
                gc.freeze()
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                outputs[name] = decode()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.process_time() - start_cpu)
        reference = outputs["continuous"]
        print(f"\ncapacity {capacity}: system | sent/s wall (cpu) | vs static | vs static, sorted "
              "| paired in rounds: vs static, vs sorted | best hypothesis as continuous's")
        base = {k: statistics.median(wall[k]) for k in ("static", "static, sorted")}
        base_cpu = {k: statistics.median(cpu[k]) for k in ("static", "static, sorted")}
        records = []
        for name in systems:
            seconds, cpu_seconds = statistics.median(wall[name]), statistics.median(cpu[name])
            paired = [
                statistics.median(b / s for b, s in zip(wall[k], wall[name], strict=True))
                for k in ("static", "static, sorted")
            ]
            same = sum(
                o[0]["tokens"].tolist() == r[0]["tokens"].tolist()
                and abs(float(o[0]["score"]) - float(r[0]["score"])) < 1e-4
                for o, r in zip(outputs[name], reference, strict=True)
            )
            print(f"  {name:19s} | {count / seconds:6.1f} ({count / cpu_seconds:6.1f}) | "
                  f"x{base['static'] / seconds:.2f} (x{base_cpu['static'] / cpu_seconds:.2f}) | "
                  f"x{base['static, sorted'] / seconds:.2f} "
                  f"(x{base_cpu['static, sorted'] / cpu_seconds:.2f}) | "
                  f"x{paired[0]:.2f}, x{paired[1]:.2f} | {same}/{count}")
            records.append(common.record(
                table=common.table_name(args.device), row=f"stream-c{capacity}",
                what=f"{args.path}: a stream of {count} sentences in random order, continuous "
                     "against static batching (batch: capacity)",
                system=name, model=args.path, precision=args.precision, batch=capacity,
                sentences_per_s=count / seconds, same_as_continuous=f"{same}/{count}",
                ratio=None if name == "static" else {"against": "static batching",
                                                     "value": paired[0]},
                command=common.command_line(), **common.machine(args.device, args.threads),
            ))  # fmt: skip
        common.append_records(args.results, records)


if __name__ == "__main__":
    main()

"""Lexically constrained decoding: fairseq's constrained generator against ours, side by side in
one run, and a stream where one sentence in five carries constraints against the same stream
without any.

Models (random weights, 8k words, beam 5): ``convs2s``, the demo's ConvS2S shape (fairseq's fconv
for fairseq, our convs2s with the same weights for us, sharpened so that outputs end at varied
lengths); ``transformer``, a fairseq transformer of configs/transformer.conf's shape (3+3 layers
x 256, 4 heads, FFN 1024, shared decoder embeddings), the same model for both. Sentences of 5 to
40 random words, each with 1 to 3 random constraints of 1 to 3 words. ``convs2s-demo``: the
checkpoint ``--path`` (an fconv or convs2s one, e.g. the demo's) on ``--data``, its test
sentences in order, with 1 to 3 random constraints of 1 to 3 target words.

Rows: ``fairseq`` (fairseq's SequenceGenerator with LexicallyConstrainedBeamSearch,
``generate`` per batch) and ``ours`` (our SequenceGenerator with the same search, ``generate``
per batch) at each batch size, ordered and unordered; ``stream`` (our engine, every sentence in
one stream, ``--stream-in-flight`` at most in flight) with no constraints (the reference) and with
constraints on one sentence in five. Each row is the median of ``--repeats`` interleaved rounds,
after a warm-up; ours are checked to give fairseq's best hypotheses. Prints a markdown table with
the CPU and kernels; ``--results FILE`` appends one JSON line a row.

    python -m benchmarks.constraints --threads 1 --results benchmarks/results/cpu-avx512.jsonl
    python -m benchmarks.constraints --models convs2s-demo --path CKPT --data DATA-BIN
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from typing import Any

import torch
from fairseq import search
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import base_architecture as transformer_base
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from fairseq.token_generation_constraints import pack_constraints

import beamplugin  # noqa: F401  (registers convs2s)
from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.models.convs2s import ConvS2SModel
from beamplugin.streams import IteratorSource, run, sentence_request
from benchmarks.common import (
    add_results_option,
    append_records,
    command_line,
    cpu_description,
    machine,
    record,
    table_name,
)
from benchmarks.models import checkpoint_models, random_fconv, same_weights

WORDS, BEAM = 8000, 5
REPRESENTATIONS = ("ordered", "unordered")
CONSTRAINED_SHARE = 5  # one sentence in this many carries constraints in the stream rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["convs2s", "transformer", "convs2s-demo"],
                        default=["convs2s", "transformer"])  # fmt: skip
    parser.add_argument("--path", help="convs2s-demo's checkpoint (fconv or convs2s)")
    parser.add_argument("--data", help="convs2s-demo's binarized data (its test split is read)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--batch-1-sentences", type=int, default=8)
    parser.add_argument("--sentences", type=int, default=64, help="timed at batch sizes > 1")
    parser.add_argument("--stream-sentences", type=int, default=160)
    parser.add_argument("--stream-in-flight", type=int, default=64)
    parser.add_argument("--max-len-b", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1)
    add_results_option(parser)
    args = parser.parse_args()
    if "convs2s-demo" in args.models and not (args.path and args.data):
        parser.error("convs2s-demo needs --path and --data")
    return args


class Sources:
    """Where a model's source sentences come from: random words of its dictionary, or the
    test split of a checkpoint's data (in order)."""

    def __init__(self, d: Dictionary, task: Any = None) -> None:
        self.d, self.sentences = d, None
        if task is not None:
            task.load_dataset("test")
            dataset = task.dataset("test")
            self.sentences = [dataset[i]["source"] for i in range(len(dataset))]

    def take(self, rng: random.Random, index: int) -> torch.Tensor:
        if self.sentences is not None:
            return self.sentences[index % len(self.sentences)]
        words = range(self.d.nspecial, len(self.d))
        return torch.tensor([rng.choice(words) for _ in range(rng.randint(5, 40))]
                            + [self.d.eos()])  # fmt: skip


def build(name: str, path: str | None = None, data: str | None = None
          ) -> tuple[torch.nn.Module, torch.nn.Module, Dictionary, Sources]:  # fmt: skip
    """fairseq's model and ours, with the same weights, their target dictionary and where
    their sources come from."""
    if name == "convs2s-demo":
        fconv, convs2s, task = checkpoint_models(path, data)
        fconv.make_generation_fast_(beamable_mm_beam_size=BEAM)
        return fconv, convs2s, task.target_dictionary, Sources(task.source_dictionary, task)
    fconv, d, args = random_fconv(WORDS, seed=1)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    if name == "transformer":
        torch.manual_seed(1)
        args = argparse.Namespace(
            encoder_layers=3, decoder_layers=3, encoder_embed_dim=256, decoder_embed_dim=256,
            encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024, encoder_attention_heads=4,
            decoder_attention_heads=4, share_decoder_input_output_embed=True, dropout=0.0,
            max_source_positions=1024, max_target_positions=1024,
        )  # fmt: skip
        transformer_base(args)
        model = TransformerModel.build_model(args, task).eval()
        with torch.no_grad():  # sharpened, so that outputs end at varied lengths
            model.decoder.output_projection.weight.mul_(4)
        return model, model, d, Sources(d)
    convs2s = same_weights(ConvS2SModel, fconv, args, task, "fconv")
    fconv.make_generation_fast_(beamable_mm_beam_size=BEAM)
    return fconv, convs2s, d, Sources(d)


def workload(sources: Sources, d: Dictionary, count: int, seed: int
             ) -> list[tuple[torch.Tensor, list[list[int]]]]:  # fmt: skip
    """``count`` sentences with their constraints (words of the target dictionary ``d``)."""
    rng = random.Random(seed)
    words = range(d.nspecial, len(d))
    out = []
    for index in range(count):
        source = sources.take(rng, seed + index)
        constraints = [[rng.choice(words) for _ in range(rng.randint(1, 3))]
                       for _ in range(rng.randint(1, 3))]  # fmt: skip
        out.append((source, constraints))
    return out


def meetable(model: torch.nn.Module, d: Dictionary, items: list, count: int, options: dict
             ) -> list:  # fmt: skip
    """The first ``count`` of ``items`` whose constraints our search meets within the maximum
    length, ordered and unordered: fairseq's generator fails a whole batch for one that does
    not (ours fails that sentence alone, with fairseq's hypotheses for the others)."""
    failed = set()
    for representation in REPRESENTATIONS:
        strategy = search.LexicallyConstrainedBeamSearch(d, representation)
        engine = DecodingEngine.of(SequenceGenerator([model], d, search_strategy=strategy,
                                                     **options), max_sentences=64)  # fmt: skip
        requests = [sentence_request(i, source, None, constraints=cs)
                    for i, (source, cs) in enumerate(items)]  # fmt: skip
        with torch.inference_mode():
            failed |= {f.key for f in run(engine, IteratorSource(iter(requests))) if f.error}
    kept = [item for i, item in enumerate(items) if i not in failed]
    if len(kept) < count:
        raise SystemExit(f"only {len(kept)} of {len(items)} sentences meet their constraints")
    return kept[:count]


def batch_of(items: list[tuple[torch.Tensor, list[list[int]]]], d: Dictionary) -> dict:
    width = max(len(s) for s, _ in items)
    src = torch.full((len(items), width), d.pad(), dtype=torch.long)
    for i, (s, _) in enumerate(items):
        src[i, width - len(s) :] = s
    lengths = torch.tensor([len(s) for s, _ in items])
    packed = pack_constraints([[torch.tensor(c) for c in cs] for _, cs in items])
    return {"net_input": {"src_tokens": src, "src_lengths": lengths}, "constraints": packed}


def generate(gen: Any, model: Any, batches: list[dict], constrained: bool = True
             ) -> tuple[float, list[list[int]], int]:  # fmt: skip
    """Seconds, best hypotheses, output tokens (EOS included); ``constrained``: with the
    batches' constraints."""
    started = time.perf_counter()
    best, tokens = [], 0
    with torch.inference_mode():
        for batch in batches:
            sample = {"net_input": batch["net_input"]}
            constraints = batch["constraints"] if constrained else None
            for hypos in gen.generate([model], sample, constraints=constraints):
                best.append(hypos[0]["tokens"].tolist())
                tokens += len(hypos[0]["tokens"])
    return time.perf_counter() - started, best, tokens


def stream(gen: SequenceGenerator, items: list, in_flight: int, constrained: bool
           ) -> tuple[float, list[list[int]], int]:  # fmt: skip
    """Every sentence through one engine; with ``constrained``, one in CONSTRAINED_SHARE keeps
    its constraints."""
    engine = DecodingEngine.of(gen, max_sentences=in_flight)
    requests = [
        sentence_request(i, source, None,
                         constraints=cs if constrained and i % CONSTRAINED_SHARE == 0 else None)
        for i, (source, cs) in enumerate(items)
    ]  # fmt: skip
    started = time.perf_counter()
    with torch.inference_mode():
        finished = {f.key: f for f in run(engine, IteratorSource(iter(requests)))}
    seconds = time.perf_counter() - started
    best = [finished[i].hypotheses[0]["tokens"].tolist() for i in range(len(items))]
    return seconds, best, sum(len(b) for b in best)


def _same(best: list[list[int]], reference: list[list[int]], stream: bool) -> str:
    """How many best hypotheses are the reference's, "n/m" (in a stream: of the sentences
    without constraints)."""
    compared = [i for i in range(len(best)) if not stream or i % CONSTRAINED_SHARE]
    return f"{sum(best[i] == reference[i] for i in compared)}/{len(compared)}"


MODELS = {"convs2s": "ConvS2S of the demo's shape", "transformer": "transformer.conf's shape",
          "convs2s-demo": "the demo's trained ConvS2S, test sentences"}  # fmt: skip


def describe(name: str, comparison: str, system: str) -> str:
    """A row's "what": the model, and what its systems decode."""
    kind, *rest = comparison.split()
    if kind == "stream":  # "stream N in flight"
        return (f"{MODELS[name]}, a stream ({' '.join(rest)}), "
                f"{system.replace('constraints ', 'sentences with constraints: ')}")  # fmt: skip
    if kind == "none":
        return f"{MODELS[name]}, {' '.join(rest)}: no constraints (ours, the ceiling)"
    return f"{MODELS[name]}, {' '.join(rest)}: {kind} constraints (1-3 a sentence)"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    where = machine(threads=args.threads)
    print(f"# {cpu_description()}, {args.threads} thread(s)")
    options = dict(beam_size=BEAM, max_len_a=0, max_len_b=args.max_len_b)
    rows: list[dict] = []
    for name in args.models:
        theirs, ours, d, sources = build(name, args.path, args.data)
        described = f"trained, {len(d)} words" if name == "convs2s-demo" else "random, 8k words"
        cases: dict[str, tuple] = {}
        for representation in REPRESENTATIONS:
            for size in args.batch_sizes:
                count = args.batch_1_sentences if size == 1 else args.sentences
                items = meetable(ours, d, workload(sources, d, 2 * count, seed=size), count,
                                 options)  # fmt: skip
                batches = [batch_of(items[i : i + size], d) for i in range(0, count, size)]
                if representation == REPRESENTATIONS[0]:  # ours without constraints: the ceiling
                    job = functools.partial(generate, SequenceGenerator([ours], d, **options), ours,
                                            batches, False)  # fmt: skip
                    cases[f"none batch {size}/ours"] = (job, size, "ours")
                for system, model in (("fairseq", theirs), ("ours", ours)):
                    strategy = search.LexicallyConstrainedBeamSearch(d, representation)
                    make = FairseqGenerator if system == "fairseq" else SequenceGenerator
                    gen = make([model], d, search_strategy=strategy, **options)
                    job = functools.partial(generate, gen, model, batches)
                    cases[f"{representation} batch {size}/{system}"] = (job, size, system)
        items = workload(sources, d, args.stream_sentences, seed=99)
        for kind in ("none", "1 in 5"):  # the reference: our plain search
            constrained = {"search_strategy": search.LexicallyConstrainedBeamSearch(d, "ordered")}
            gen = SequenceGenerator([ours], d, **options, **({} if kind == "none" else constrained))
            job = functools.partial(stream, gen, items, args.stream_in_flight, kind != "none")
            cases[f"stream {args.stream_in_flight} in flight/constraints {kind}"] = (
                job, args.stream_in_flight, "ours")  # fmt: skip
        times: dict[str, list[float]] = {key: [] for key in cases}
        outputs: dict[str, tuple] = {}
        for key, (job, _, _) in cases.items():  # warm-up
            outputs[key] = job()[1:]
        for _ in range(args.repeats):
            for key, (job, _, _) in cases.items():
                times[key].append(job()[0])
        for key, (_, size, system) in cases.items():
            comparison = key.split("/")[0]
            reference = {"stream": f"{comparison}/constraints none",
                         "none": f"{comparison.replace('none', 'ordered')}/fairseq"}.get(
                comparison.split()[0], f"{comparison}/fairseq")  # fmt: skip
            seconds = statistics.median(times[key])
            tokens = outputs[key][1]
            ratio = statistics.median(times[reference]) / seconds
            row = f"constraints-{name}-{comparison.replace(' ', '-')}"
            if "stream" in key:  # each stream a row of its own, so that both are "ours"
                row += "-" + key.split("/")[1].replace("constraints ", "").replace(" ", "-")
            if "stream" in key:
                extra = {"unconstrained_same": _same(outputs[key][0], outputs[reference][0], True)}
            else:
                extra = {}
            rows.append(record(
                table=table_name(),
                row=row,
                what=describe(name, comparison, key.split("/")[1]),
                system=system, model=f"{name} ({described})", precision="float32",
                batch=size, tokens_per_s=round(tokens / seconds, 1),
                ratio={"against": {"constraints none": "no constraints",
                                   "fairseq": "fairseq" if "none" not in comparison
                                   else "fairseq, ordered constraints"}[reference.split("/")[1]],
                       "value": round(ratio, 2)},
                # (a stream's: printed, not recorded: the table's column is fairseq's)
                same_as_reference=None if comparison.split()[0] in ("none", "stream")
                else _same(outputs[key][0], outputs[reference][0], False),
                command=command_line(), **where, **extra,
            ))  # fmt: skip
    print("| model | comparison | system | tokens/s | ratio | same best as reference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['model']} | {row['row']} | {row['system']} | "
              f"{row['tokens_per_s']} | x{row['ratio']['value']} vs {row['ratio']['against']} | "
              f"{row['same_as_reference'] or row.get('unconstrained_same', '')} |")  # fmt: skip
    append_records(args.results, rows)


if __name__ == "__main__":
    main()

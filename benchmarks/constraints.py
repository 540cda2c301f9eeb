"""Lexically constrained decoding: fairseq's constrained generator against ours, side by side in
one run, and a stream where one sentence in five carries constraints against the same stream
without any.

Models (random weights, 8k words, beam 5): ``convs2s``, the demo's ConvS2S shape (fairseq's fconv
for fairseq, our convs2s with the same weights for us, sharpened so that outputs end at varied
lengths); ``transformer``, a fairseq transformer of configs/transformer.conf's shape (3+3 layers
x 256, 4 heads, FFN 1024, shared decoder embeddings), the same model for both. Sentences of 5 to
40 random words, each with 1 to 3 random constraints of 1 to 3 words. With ``--path`` and
``--data``, a trained convs2s checkpoint too (``demo``: stream rows only), on its test set, a
constrained sentence's constraints 1 or 2 words of its reference (whole words of 4 letters or
more, as a glossary's terms), so that outputs keep their natural lengths.

Rows: ``fairseq`` (fairseq's SequenceGenerator with LexicallyConstrainedBeamSearch,
``generate`` per batch) and ``ours`` (our SequenceGenerator with the same search, ``generate``
per batch) at each batch size, ordered and unordered; ``stream`` (our engine, every sentence in
one stream, ``--stream-in-flight`` at most in flight) with no constraints (the reference) and with
constraints on one sentence in five. Each row is the median of ``--repeats`` interleaved rounds,
after a warm-up; ours are checked to give fairseq's best hypotheses. Prints a markdown table with
the CPU and kernels; ``--results FILE`` appends one JSON line a row.

A stream's ratio is its time per sentence-step (a sentence in flight for a step: the work a
step does) against the stream without constraints: what the constraints cost the stream's work.
Constrained sentences often end later (end of sentence waits for their constraints), so the
stream does more sentence-steps and takes longer in all; that is their translation's length, not
a cost to the others, and is recorded beside (``wall_ratio``: the stream's time, ``work``: its
sentence-steps against the unconstrained stream's).

    python -m benchmarks.constraints --threads 1 --path data/work/checkpoints/checkpoint_best.pt \\
        --data data/work/bin --results benchmarks/results/cpu-avx512.jsonl
"""

from __future__ import annotations

import argparse
import functools
import random
import re
import statistics
import time
from typing import Any

import torch
from fairseq import checkpoint_utils, search
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
from benchmarks.models import random_fconv, same_weights

WORDS, BEAM = 8000, 5
REPRESENTATIONS = ("ordered", "unordered")
CONSTRAINED_SHARE = 5  # one sentence in this many carries constraints in the stream rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", choices=["convs2s", "transformer"],
                        default=["convs2s", "transformer"])  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--batch-1-sentences", type=int, default=8)
    parser.add_argument("--sentences", type=int, default=64, help="timed at batch sizes > 1")
    parser.add_argument("--stream-sentences", type=int, default=160, help="0: no stream rows")
    parser.add_argument("--stream-in-flight", type=int, default=64)
    parser.add_argument("--max-len-b", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--path", help="a trained convs2s checkpoint: stream rows on it too")
    parser.add_argument("--data", help="its binarized data directory (test set, dictionaries)")
    parser.add_argument("--checkpoint-sentences", type=int, default=500,
                        help="its stream: the first this many test sentences")  # fmt: skip
    add_results_option(parser)
    args = parser.parse_args()
    if (args.path is None) != (args.data is None):
        parser.error("--path and --data go together")
    return args


def build(name: str) -> tuple[torch.nn.Module, torch.nn.Module, Dictionary]:
    """fairseq's model and ours, with the same random weights, and their dictionary."""
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
        return model, model, d
    convs2s = same_weights(ConvS2SModel, fconv, args, task, "fconv")
    fconv.make_generation_fast_(beamable_mm_beam_size=BEAM)
    return fconv, convs2s, d


def trained(path: str, data: str, count: int) -> tuple[torch.nn.Module, Dictionary, list]:
    """A trained convs2s checkpoint, its target dictionary and the first ``count`` sentences of
    its test set, each with 1 or 2 words of its reference as constraints."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data}
    )
    task.load_dataset("test")
    dataset, d = task.dataset("test"), task.target_dictionary
    rng = random.Random(5)
    items = []
    for i in range(min(count, len(dataset))):
        terms = reference_words(dataset[i]["target"].tolist(), d)
        chosen = rng.sample(terms, min(len(terms), rng.randint(1, 2)))
        items.append((dataset[i]["source"], chosen))
    return models[0].eval(), d, items


def reference_words(target: list[int], d: Dictionary) -> list[list[int]]:
    """The whole words of a reference (a sentencepiece piece that starts a word and those that
    continue it) of at least four letters, as token sequences: a glossary's terms."""
    words: list[list[int]] = []
    for token in target[:-1]:  # EOS last
        if d[token].startswith("\u2581") or not words:
            words.append([])
        words[-1].append(token)
    letters = re.compile(r"[^\W\d_]")
    return [w for w in words
            if len(letters.findall("".join(d[t] for t in w))) >= 4]  # fmt: skip


def workload(d: Dictionary, count: int, seed: int) -> list[tuple[torch.Tensor, list[list[int]]]]:
    """``count`` sentences with their constraints."""
    rng = random.Random(seed)
    words = range(d.nspecial, len(d))
    out = []
    for _ in range(count):
        source = [rng.choice(words) for _ in range(rng.randint(5, 40))] + [d.eos()]
        constraints = [[rng.choice(words) for _ in range(rng.randint(1, 3))]
                       for _ in range(rng.randint(1, 3))]  # fmt: skip
        out.append((torch.tensor(source), constraints))
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


class Work:
    """A stream's observer: its sentence-steps (each step's sentences in flight, summed)."""

    def __init__(self) -> None:
        self.sentence_steps = 0

    def admitted(self, keys: list[Any]) -> None:
        pass

    def stepped(self, sentences: int, seconds: float) -> None:
        self.sentence_steps += sentences


def stream(gen: SequenceGenerator, items: list, in_flight: int, constrained: bool
           ) -> tuple[float, list[list[int]], int, int]:  # fmt: skip
    """Every sentence through one engine; with ``constrained``, one in CONSTRAINED_SHARE keeps
    its constraints. Seconds, best hypotheses (empty where its constraints were not met),
    output tokens and sentence-steps."""
    engine = DecodingEngine.of(gen, max_sentences=in_flight)
    requests = [
        sentence_request(i, source, None,
                         constraints=cs if constrained and i % CONSTRAINED_SHARE == 0 else None)
        for i, (source, cs) in enumerate(items)
    ]  # fmt: skip
    work = Work()
    started = time.perf_counter()
    with torch.inference_mode():
        finished = {f.key: f for f in run(engine, IteratorSource(iter(requests)), work)}
    seconds = time.perf_counter() - started
    best = [finished[i].hypotheses[0]["tokens"].tolist() if finished[i].hypotheses else []
            for i in range(len(items))]  # fmt: skip
    return seconds, best, sum(len(b) for b in best), work.sentence_steps


def _same(best: list[list[int]], reference: list[list[int]], stream: bool) -> str:
    """How many best hypotheses are the reference's, "n/m" (in a stream: of the sentences
    without constraints)."""
    compared = [i for i in range(len(best)) if not stream or i % CONSTRAINED_SHARE]
    return f"{sum(best[i] == reference[i] for i in compared)}/{len(compared)}"


MODELS = {"convs2s": "ConvS2S of the demo's shape", "transformer": "transformer.conf's shape",
          "demo": "the demo's trained ConvS2S (test set; constraints: reference words)"}


def describe(name: str, comparison: str, system: str) -> str:
    """A row's "what": the model, and what its systems decode."""
    kind, *rest = comparison.split()
    if kind == "stream":  # "stream N in flight"
        return (f"{MODELS[name]}, a stream ({' '.join(rest)}), "
                f"{system.replace('constraints ', 'sentences with constraints: ')}")  # fmt: skip
    if kind == "none":
        return f"{MODELS[name]}, {' '.join(rest)}: no constraints (ours, the ceiling)"
    return f"{MODELS[name]}, {' '.join(rest)}: {kind} constraints (1-3 a sentence)"


def batch_cases(theirs: Any, ours: Any, d: Dictionary, args: argparse.Namespace, options: dict
                ) -> dict[str, tuple]:  # fmt: skip
    """fairseq's constrained generator and ours at each batch size, and ours unconstrained."""
    cases: dict[str, tuple] = {}
    for representation in REPRESENTATIONS:
        for size in args.batch_sizes:
            count = args.batch_1_sentences if size == 1 else args.sentences
            items = meetable(ours, d, workload(d, 2 * count, seed=size), count, options)
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
    return cases


def stream_cases(ours: Any, d: Dictionary, items: list, in_flight: int, options: dict
                 ) -> dict[str, tuple]:  # fmt: skip
    """The stream without constraints (the reference: our plain search) and with them on one
    sentence in CONSTRAINED_SHARE."""
    cases: dict[str, tuple] = {}
    for kind in ("none", "1 in 5"):
        constrained = {"search_strategy": search.LexicallyConstrainedBeamSearch(d, "ordered")}
        gen = SequenceGenerator([ours], d, **options, **({} if kind == "none" else constrained))
        job = functools.partial(stream, gen, items, in_flight, kind != "none")
        cases[f"stream {in_flight} in flight/constraints {kind}"] = (job, in_flight, "ours")
    return cases


def measured(cases: dict[str, tuple], repeats: int) -> tuple[dict[str, float], dict[str, tuple]]:
    """Each case's median seconds over ``repeats`` interleaved rounds after a warm-up, and what
    its warm-up returned besides its seconds."""
    times: dict[str, list[float]] = {key: [] for key in cases}
    outputs = {key: job()[1:] for key, (job, _, _) in cases.items()}
    for _ in range(repeats):
        for key, (job, _, _) in cases.items():
            times[key].append(job()[0])
    return {key: statistics.median(t) for key, t in times.items()}, outputs


def records(name: str, model: str, cases: dict[str, tuple], seconds: dict[str, float],
            outputs: dict[str, tuple], where: dict) -> list[dict]:  # fmt: skip
    """A record a case: tokens/s, its ratio and agreement with its reference."""
    rows = []
    for key, (_, size, system) in cases.items():
        comparison, kind = key.split("/")
        reference = {"stream": f"{comparison}/constraints none",
                     "none": f"{comparison.replace('none', 'ordered')}/fairseq"}.get(
            comparison.split()[0], f"{comparison}/fairseq")  # fmt: skip
        tokens = outputs[key][1]
        ratio = seconds[reference] / seconds[key]
        row = f"constraints-{name}-{comparison.replace(' ', '-')}"
        extra: dict[str, Any] = {}
        if "stream" in key:  # each stream a row of its own, so that both are "ours"
            row += "-" + kind.replace("constraints ", "").replace(" ", "-")
            work = outputs[key][2] / outputs[reference][2]
            extra = {"unconstrained_same": _same(outputs[key][0], outputs[reference][0], True),
                     "wall_ratio": round(ratio, 2), "work": round(work, 3)}  # fmt: skip
            ratio *= work  # per sentence-step
        against = {"constraints none": "no constraints, per sentence-step",
                   "fairseq": "fairseq" if "none" not in comparison
                   else "fairseq, ordered constraints"}[reference.split("/")[1]]  # fmt: skip
        rows.append(record(
            table=table_name(), row=row, what=describe(name, comparison, kind),
            system=system, model=model, precision="float32", batch=size,
            tokens_per_s=round(tokens / seconds[key], 1),
            ratio={"against": against, "value": round(ratio, 2)},
            # (a stream's: printed, not recorded: the table's column is fairseq's)
            same_as_reference=None if comparison.split()[0] in ("none", "stream")
            else _same(outputs[key][0], outputs[reference][0], False),
            command=command_line(), **where, **extra,
        ))  # fmt: skip
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    where = machine(threads=args.threads)
    print(f"# {cpu_description()}, {args.threads} thread(s)")
    options = dict(beam_size=BEAM, max_len_a=0, max_len_b=args.max_len_b)
    rows: list[dict] = []
    for name in args.models:
        theirs, ours, d = build(name)
        cases = batch_cases(theirs, ours, d, args, options)
        if args.stream_sentences:
            items = workload(d, args.stream_sentences, seed=99)
            cases |= stream_cases(ours, d, items, args.stream_in_flight, options)
        rows += records(name, f"{name} (random, 8k words)", cases,
                        *measured(cases, args.repeats), where)  # fmt: skip
    if args.path:
        ours, d, items = trained(args.path, args.data, args.checkpoint_sentences)
        cases = stream_cases(ours, d, items, args.stream_in_flight, options)
        rows += records("demo", args.path, cases, *measured(cases, args.repeats), where)
    print("| model | comparison | system | tokens/s | ratio | same best as reference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        stream_figures = (f" (in all x{row['wall_ratio']}, sentence-steps x{row['work']})"
                          if "wall_ratio" in row else "")  # fmt: skip
        print(f"| {row['model']} | {row['row']} | {row['system']} | "
              f"{row['tokens_per_s']} | x{row['ratio']['value']} vs {row['ratio']['against']}"
              f"{stream_figures} | "
              f"{row['same_as_reference'] or row.get('unconstrained_same', '')} |")  # fmt: skip
    append_records(args.results, rows)


if __name__ == "__main__":
    main()

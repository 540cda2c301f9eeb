"""A stream of sentences to several target languages against a stream of the same sentences to
one: does mixing target languages in the engine's steps cost anything?

A multilingual model of task ``beam_translation_multi`` (a random transformer built here, or a
checkpoint: ``--path`` with its data directory and task options, as fairseq-generate takes them)
decodes the same sources twice per round, each sentence its own request on one engine with
``--capacity`` sentences in flight (as the server and fairseq-generate decode):

* ``one pair``: every sentence to the first target language;
* ``mixed``: sentence i to target i mod k (each with its own language token).

By default every hypothesis is exactly ``--length`` tokens long (``--min-len`` = ``--max-len-b``),
so both streams do the same work and only the mixing differs; ``--length 0`` lets them end
where the model ends them (then compare tokens/s). Rounds interleave the two in a shuffled
order; medians are printed, with the CPU's flags, the ratio of the medians and the median of
each round's ratio, and whether the sentences of the first target got the same hypotheses in
both streams.

    python -m benchmarks.multilingual --sentences 128 --capacity 16 64 --repeats 5
    python -m benchmarks.multilingual DATA-BIN --path m2m.pt --fixed-dictionary \\
        model_dict.128k.txt --lang-pairs language_pairs_small_models.txt \\
        --encoder-langtok src --decoder-langtok -s en -t fr --targets fr de es
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import beamplugin  # noqa: F401  (registers the tasks, safe checkpoint loading)
from beamplugin.engine import DecodingEngine
from beamplugin.streams import IteratorSource, run, sentence_request
from benchmarks import common
from benchmarks.common import cpu_description

LANGUAGES = ["de", "en", "fr", "es"]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--capacity", type=int, nargs="+", default=[16, 64],
                        help="sentences in flight")  # fmt: skip
    parser.add_argument("--length", type=int, default=30,
                        help="every hypothesis this long (0: as the model ends it)")
    parser.add_argument("--targets", nargs="+", help="target languages (default: all of -s's)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--random-size", type=int, nargs=3, default=[3, 256, 8000],
                        metavar=("LAYERS", "DIM", "VOCAB"),
                        help="the random model: layers each side, width, words")  # fmt: skip
    common.add_results_option(parser)
    return parser.parse_known_args()


def random_model(root: Path, layers: int, dim: int, words: int) -> list[str]:
    """A data directory and a random transformer of task translation_multi_simple_epoch in
    ``root``: the fairseq options that decode it."""
    dictionary = Dictionary()
    for i in range(words):
        dictionary.add_symbol(f"w{i}")
    dictionary.finalize(padding_factor=8)
    dictionary.save(str(root / "dict.txt"))
    pairs = ",".join(f"{a}-{b}" for a in LANGUAGES for b in LANGUAGES if a != b)
    task_options = [str(root), "--lang-pairs", pairs, "--encoder-langtok", "src",
                    "--decoder-langtok", "--fixed-dictionary", str(root / "dict.txt")]
    shape = [f"--{side}-{what}" for side in ("encoder", "decoder")
             for what in ("layers", "embed-dim", "ffn-embed-dim", "attention-heads")]
    values = [layers, dim, 4 * dim, max(1, dim // 64)] * 2
    args = options.parse_args_and_arch(options.get_training_parser(), [
        *task_options, "--task", "translation_multi_simple_epoch", "--arch", "transformer",
        *(str(x) for pair in zip(shape, values, strict=True) for x in pair),
        "--share-all-embeddings", "--cpu", "--optimizer", "adam",
    ])  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(1)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    state = {"args": args, "model": model.state_dict(), "extra_state": {}, "optimizer_history": [
        {"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
         "lr_scheduler_state": {"best": None}, "num_updates": 0},
    ]}  # fmt: skip
    torch.save(state, root / "model.pt")
    return [*task_options, "--path", str(root / "model.pt"), "-s", "de", "-t", "en"]


def decoder(fairseq_args: list[str], length: int) -> tuple[Any, Any]:
    """The task (beam_translation_multi) and our generator of fairseq's options."""
    lengths = ["--min-len", str(length), "--max-len-a", "0", "--max-len-b", str(length)]
    args = options.parse_args_and_arch(options.get_generation_parser(), [
        *fairseq_args, "--user-dir", str(Path(beamplugin.__file__).parent),
        "--task", "beam_translation_multi", "--cpu", *(lengths if length else []),
    ])  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([cfg.common_eval.path], task=task)
    return task, task.build_generator(models, cfg.generation)


def sources(task: Any, count: int) -> list[torch.Tensor]:
    """Random words, 5 to 30 a sentence, ending in EOS."""
    rng = random.Random(0)
    d = task.source_dictionary
    words = [i for i in range(d.nspecial, len(d)) if not d[i].startswith(("__", "madeupword"))]
    return [torch.tensor([*rng.choices(words, k=rng.randint(5, 30)), d.eos()])
            for _ in range(count)]  # fmt: skip


def decode(generator: Any, capacity: int, requests: list) -> tuple[float, dict]:
    """Seconds to decode ``requests`` (sentence, pair's prompt) on one engine; the results."""
    engine = DecodingEngine.of(generator, capacity)
    stream = (sentence_request(i, tokens, prefix, bos)
              for i, (tokens, (prefix, bos)) in enumerate(requests))  # fmt: skip
    started = time.perf_counter()
    with torch.inference_mode():
        results = {f.key: f.hypotheses for f in run(engine, IteratorSource(stream))}
    return time.perf_counter() - started, results


def streams_of(task: Any, texts: list[torch.Tensor], targets: list[str]) -> dict[str, list]:
    """Each stream's requests: (source tokens, prompt) a sentence."""
    languages = task.languages
    pairs = [(languages.default[0], target) for target in targets]

    def requests(pair_of: Any) -> list:
        return [(languages.source_tokens(pair_of(i), t), languages.prompt(pair_of(i)))
                for i, t in enumerate(texts)]  # fmt: skip

    return {"one pair": requests(lambda i: pairs[0]),
            "mixed": requests(lambda i: pairs[i % len(pairs)])}  # fmt: skip


def measure(generator: Any, capacity: int, streams: dict[str, list], repeats: int,
            rng: random.Random) -> tuple[dict[str, list[float]], dict[str, dict]]:  # fmt: skip
    """Each stream's seconds over ``repeats`` interleaved rounds, after an untimed decode that
    gives its results."""
    results = {name: decode(generator, capacity, requests)[1]
               for name, requests in streams.items()}  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in streams}
    for _ in range(repeats):
        for name in rng.sample(list(streams), len(streams)):
            seconds[name].append(decode(generator, capacity, streams[name])[0])
    return seconds, results


def report(seconds: dict[str, list[float]], results: dict[str, dict],
           every: int) -> list[dict[str, Any]]:
    """Medians, the ratio, and whether the mixed stream's sentences to the first target (every
    ``every``-th) got the one-pair stream's hypotheses; a record's figures a stream."""
    figures = []
    for name, times in seconds.items():
        median = statistics.median(times)
        tokens = sum(len(h[0]["tokens"]) for h in results[name].values())
        print(f"  {name:9s} {median:7.3f} s  {len(results[name]) / median:7.1f} sentences/s  "
              f"{tokens / median:8.1f} tokens/s")  # fmt: skip
        figures.append(dict(system=name, sentences_per_s=len(results[name]) / median,
                            tokens_per_s=tokens / median))
    ratio = statistics.median(seconds["mixed"]) / statistics.median(seconds["one pair"])
    # each round's two runs are within seconds of each other: their ratio drifts less than the
    # machine's speed does between rounds
    paired = statistics.median(m / o for m, o in zip(seconds["mixed"], seconds["one pair"],
                                                     strict=True))  # fmt: skip
    one, mixed = results["one pair"], results["mixed"]
    same = all(torch.equal(one[i][0]["tokens"], mixed[i][0]["tokens"])
               for i in range(0, len(one), every))  # fmt: skip
    print(f"  mixed / one pair: x{ratio:.3f} time (median of the rounds' ratios x{paired:.3f}); "
          f"the sentences to the first target got the same hypotheses in both: {same}")
    figures[-1].update(ratio={"against": "one pair", "value": 1 / paired},
                       same_as_one_pair=same)  # fmt: skip
    return figures


def main() -> None:
    args, fairseq_args = parse_args()
    torch.set_num_threads(args.threads)
    given = "--path" in fairseq_args
    model = fairseq_args[fairseq_args.index("--path") + 1] if given else "random transformer"
    with tempfile.TemporaryDirectory() as root:
        if not given:
            fairseq_args = random_model(Path(root), *args.random_size)
        task, generator = decoder(fairseq_args, args.length)
    source = task.languages.default[0]
    targets = args.targets or task.languages.targets(source)
    streams = streams_of(task, sources(task, args.sentences), targets)
    print(f"{cpu_description()}; torch threads {args.threads}")
    print(f"{args.sentences} sentences from {source} to {'/'.join(targets)}, beam "
          f"{generator.beam_size}, hypotheses of {args.length or 'any'} tokens")
    rng = random.Random(1)
    for capacity in args.capacity:
        seconds, results = measure(generator, capacity, streams, args.repeats, rng)
        print(f"\ncapacity {capacity}: median of {args.repeats} rounds")
        figures = report(seconds, results, len(targets))
        common.append_records(args.results, [common.record(
            table=common.table_name(), row=f"multilingual-c{capacity}",
            what=f"{args.sentences} sentences from {source} to {'/'.join(targets)} mixed in one "
                 "stream against one target's (batch: capacity)",
            model=model, precision="float32", batch=capacity,
            command=common.command_line(), **figure, **common.machine(threads=args.threads),
        ) for figure in figures])  # fmt: skip
        sys.stdout.flush()


if __name__ == "__main__":
    main()

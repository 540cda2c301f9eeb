"""A fairseq transformer checkpoint decoded by fairseq's generator, ours and CTranslate2, side by
side in one run: sentences/s at each batch size and thread count, each against fairseq's and
against CTranslate2 float32, the share of best hypotheses equal to fairseq's, and BLEU. An fconv
or convs2s checkpoint too: fairseq's fconv against our convs2s on the same weights (CTranslate2
converts no ConvS2S).

Systems (beam 5, lenpen 1, max_len_b 200, one test-set order sorted by source length, batches of
B consecutive sentences, as fairseq-generate makes them):

* ``fairseq``: fairseq's SequenceGenerator, ``generate`` per batch;
* ``ours`` / ``ours int8``: beamplugin's engine as fairseq-generate runs it through task
  ``beam_translation`` (and as fairseq-interactive and the server do): every sentence in one
  stream, at most B in flight (``beamplugin.streams.translate``), no attention kept (none is
  printed without ``--print-alignment``; CTranslate2 returns none either) and one hypothesis
  returned a sentence (fairseq-generate's ``--nbest 1``, CTranslate2's ``num_hypotheses=1``), in
  float32 and with ``--int8``'s products;
* ``ours generate``: beamplugin's SequenceGenerator, ``generate`` per batch as fairseq's (float32;
  at batch 1 each call's own setup shows);
* ``ours torch kernels``: ``ours`` with ``BEAMPLUGIN_ISA=off`` (torch's kernels only, as without a
  C compiler): our kernels must never be slower than that;
* ``ct2 float32`` / ``ct2 int8``: CTranslate2 on the same weights (``ct2-fairseq-converter``),
  every sentence in one ``translate_batch`` with ``max_batch_size`` B, intra_threads = the
  thread count.

Every timing runs in a process of its own that loads only its system (CTranslate2's without
torch), decodes once to warm up, then once timed: in one process the idle threads of one
runtime's pool (torch's OpenMP, CTranslate2's) spin on the cores the other needs, which made
every system slower with 2 threads than with 1 (docs/benchmarks.md, 2026-11-25). Each round
runs the systems in a shuffled order; the median over rounds is printed, with the CPU's model
name and flags. CTranslate2 is a benchmark-only dependency: ``pip install -e '.[bench]'``.

Each worker inherits the environment: ``BEAMPLUGIN_ISA=avx2`` pins our AVX2 kernels,
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` holds torch's (fairseq's) to AVX2 and
``CT2_FORCE_CPU_ISA=AVX2`` CTranslate2's, as on a CPU without AVX-512.

    python scripts/bench_transformer.py --path CHECKPOINT --data DATA_BIN \\
        --sentences 256 --batch-sizes 1 64 --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BEAM, MAX_LEN_B = 5, 200
SYSTEMS = ["fairseq", "ours", "ours int8", "ours generate", "ours torch kernels", "ct2 float32",
           "ct2 int8"]  # fmt: skip
OURS_STREAMED = ("ours", "ours int8", "ours torch kernels")


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
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    return parser.parse_args()


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


# ---- a worker: one system, one thread count, one batch size, one timed decode ----------------


def worker(args: argparse.Namespace) -> None:
    """Decode the job's sentences twice with ``args.worker``, print the second's seconds and
    its best hypotheses (token ids for fairseq and ours, words for CTranslate2) as JSON."""
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    if args.worker.startswith("ct2"):
        decode = ct2_decoder(job, args.worker.split()[1], job["threads"])
    else:
        decode = torch_decoder(args, job)
    decode()
    start = time.perf_counter()
    best = decode()
    print(json.dumps({"seconds": time.perf_counter() - start, "best": best}))


def ct2_decoder(job: dict[str, Any], compute_type: str, threads: int) -> Any:
    import ctranslate2  # the only runtime in this process

    translator = ctranslate2.Translator(
        job["ct2"][compute_type], device="cpu", compute_type=compute_type,
        intra_threads=threads, inter_threads=1,
    )  # fmt: skip

    def decode() -> list[list[str]]:
        results = translator.translate_batch(
            job["words"], beam_size=BEAM, max_batch_size=job["batch"], length_penalty=1.0,
            max_decoding_length=MAX_LEN_B, return_scores=False,
        )  # fmt: skip
        return [r.hypotheses[0] for r in results]

    return decode


def torch_decoder(args: argparse.Namespace, job: dict[str, Any]) -> Any:
    import torch
    from bench_generate import checkpoint_models, prepare
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

    import beamplugin  # noqa: F401  (registers the task, safe checkpoint loading)
    from beamplugin import SequenceGenerator
    from beamplugin.fairseq_plugin.precision import cast_for_decoding
    from beamplugin.streams.translate import translate

    torch.set_num_threads(job["threads"])
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    model = models[0].eval()
    if convolutional(model):  # fairseq's fconv against our convs2s, the same weights
        fconv, convs2s, _ = checkpoint_models(args.path, args.data)
        model = prepare(fconv, BEAM) if args.worker == "fairseq" else convs2s
    if args.worker == "ours int8":
        cast_for_decoding([model], "int8")
    options: dict[str, Any] = dict(beam_size=BEAM, max_len_b=MAX_LEN_B)
    streams = args.worker in OURS_STREAMED
    if streams:  # as task beam_translation builds it without --print-alignment, --nbest 1
        options.update(attention=False, nbest=1)
    kind = FairseqGenerator if args.worker == "fairseq" else SequenceGenerator
    generator = kind([model], task.target_dictionary, **options)
    pad, batch = task.source_dictionary.pad(), job["batch"]
    sources = [torch.tensor(s) for s in job["sources"]]

    def streamed() -> list[list[int]]:
        results = translate(generator, sources, max_sentences=batch, ordered=True)
        return [hypotheses[0]["tokens"].tolist() for _, hypotheses in results]

    def decode() -> list[list[int]]:
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

    return streamed if streams else decode


# ---- the run: workers in turns, the table ------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    from bench_generate import cpu_description
    from fairseq import checkpoint_utils

    import beamplugin  # noqa: F401  (registers the task, safe checkpoint loading)

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    dictionary, eos = task.target_dictionary, task.target_dictionary.eos()
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    items = sorted((dataset[i] for i in range(min(args.sentences, len(dataset)))),
                   key=lambda item: len(item["source"]))
    sources = [item["source"].tolist() for item in items]
    references = [dictionary.string(item["target"], "sentencepiece") for item in items]
    workdir = Path(tempfile.mkdtemp(prefix="bench-transformer-"))
    systems = SYSTEMS[:5]
    ct2: dict[str, str] = {}
    try:
        import ctranslate2  # noqa: F401

        if not convolutional(models[0]):
            ct2 = {kind: str(ct2_model(args.path, args.data, None if kind == "float32" else kind,
                                       workdir)) for kind in ("float32", "int8")}
            systems = SYSTEMS
    except ImportError:
        print("# ctranslate2 is not installed (pip install -e '.[bench]'): without CTranslate2")
    print(f"# {args.path}; beam {BEAM}; {cpu_description()}; torch {torch.__version__}; "
          "each timing in a process of its own")
    rng = random.Random(1)
    for threads in args.threads:
        for batch in args.batch_sizes:
            count = len(sources) if batch > 1 else min(args.batch_1_sentences, len(sources))
            job = workdir / f"job-{threads}-{batch}.json"
            job.write_text(json.dumps({
                "threads": threads, "batch": batch, "sources": sources[:count], "ct2": ct2,
                "words": [[dictionary[t] for t in s if t != eos] for s in sources[:count]],
            }), encoding="utf-8")  # fmt: skip
            seconds: dict[str, list[float]] = {name: [] for name in systems}
            outputs: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for name in rng.sample(systems, len(systems)):
                    result = run_worker(args, name, job)
                    seconds[name].append(result["seconds"])
                    outputs[name] = (
                        [[dictionary.index(w) for w in h] + [eos] for h in result["best"]]
                        if name.startswith("ct2") else result["best"]
                    )
            report(threads, batch, count, seconds, outputs, references, dictionary)


def convolutional(model: Any) -> bool:
    """Whether ``model`` is an fconv or a convs2s (else a transformer)."""
    from fairseq.models.fconv import FConvModel

    from beamplugin.models.convs2s import ConvS2SModel

    return isinstance(model, FConvModel | ConvS2SModel)


def run_worker(args: argparse.Namespace, name: str, job: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--path", args.path, "--data", args.data,
               "--worker", name, "--job", str(job)]
    env = {**os.environ, "BEAMPLUGIN_ISA": "off"} if name == "ours torch kernels" else None
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(threads: int, batch: int, count: int, seconds: dict, outputs: dict,
           references: list[str], dictionary: Any) -> None:
    import sacrebleu
    import torch

    median = {name: statistics.median(s) for name, s in seconds.items()}
    base = median["fairseq"]
    ct2, ct2_int8 = median.get("ct2 float32"), median.get("ct2 int8")
    print(f"\n## {threads} thread(s), batch {batch}: {count} sentences, "
          f"median of {len(next(iter(seconds.values())))} rounds")
    for name, time_taken in median.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs["fairseq"], strict=True))
        text = [dictionary.string(torch.tensor(h), "sentencepiece") for h in outputs[name]]
        bleu = sacrebleu.corpus_bleu(text, [references[: len(text)]]).score
        against_ct2 = (
            f"  x{ct2 / time_taken:5.2f} ct2 float32  x{ct2_int8 / time_taken:5.2f} ct2 int8"
            if ct2 and ct2_int8 else ""
        )
        print(f"{name:12s} {count / time_taken:7.1f} sent/s  x{base / time_taken:5.2f} "
              f"fairseq{against_ct2}  same best as fairseq {same}/{count}  "
              f"BLEU {bleu:5.2f}")


if __name__ == "__main__":
    main()

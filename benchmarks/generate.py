"""Our decoding against fairseq's generator (and CTranslate2's): a fairseq checkpoint decoded by
fairseq's generator, ours and CTranslate2, side by side in one run: sentences/s and tokens/s at
each batch size and thread count, each against fairseq's and against CTranslate2's, the share of
best hypotheses equal to fairseq's, BLEU, and each system's peak resident memory and load time.
An fconv or convs2s checkpoint too: fairseq's fconv against our convs2s on the same weights
(CTranslate2 converts no ConvS2S).

Systems (beam 5, lenpen 1, max_len_a 0, max_len_b 200 (``--max-len-b``), one test-set order
sorted by source length, batches of B consecutive sentences, as fairseq-generate makes them):

* ``fairseq``: fairseq's SequenceGenerator, ``generate`` per batch;
* ``ours`` / ``ours int8`` / ``ours bf16``: beamplugin's engine as fairseq-generate runs it
  through task ``beam_translation`` (and as fairseq-interactive and the server do): every
  sentence in one stream, at most B in flight (``beamplugin.streams.translate``), no attention
  kept (none is printed without ``--print-alignment``; CTranslate2 returns none either) and one
  hypothesis returned a sentence (fairseq-generate's ``--nbest 1``, CTranslate2's
  ``num_hypotheses=1``), in float32, with ``--int8``'s products and with ``--bf16``'s (on a CPU
  with bfloat16 products only; its speed also against ours in float32);
* ``ours generate``: beamplugin's SequenceGenerator, ``generate`` per batch as fairseq's (float32;
  at batch 1 each call's own setup shows);
* ``ours torch kernels``: ``ours`` with ``BEAMPLUGIN_ISA=off`` (torch's kernels only, as without a
  C compiler): our kernels must never be slower than that;
* ``ours vmap`` / ``ours int8 vmap`` / ``ct2 float32 vmap`` / ``ct2 int8 vmap``, with
  ``--vocabulary-map``: the same, each sentence on its shortlist (our ``--vocabulary-map``,
  CTranslate2's ``use_vmap`` on the map converted in), so their hypotheses differ from
  fairseq's by design;
* ``ct2 float32`` / ``ct2 int8``: CTranslate2 on the same weights (``ct2-fairseq-converter``),
  every sentence in one ``translate_batch`` with ``max_batch_size`` B, intra_threads = the
  thread count, max_decoding_length = max_len_b + 1: fairseq decodes up to max_len_b tokens,
  then one more step forced to EOS; CTranslate2 counts steps and forces nothing, so both decode
  max_len_b + 1 steps at most. A CTranslate2 hypothesis that reaches the limit is compared and
  scored without its last word, which stands where fairseq's forced EOS does (CTranslate2 has no
  max_len_a: the limit is the same for every source length).

tokens/s counts the tokens of each system's best hypotheses, EOS included (each is a decoder
step). A worker's load time runs from loading the checkpoint (its runtime's imports done) to
ready to decode (for ``ours int8`` the weights cast, for every system its generator built),
before the warm-up decode; its peak resident memory is Linux's VmHWM at the end (the model, the
runtime and both decodes), the largest over rounds. ``fairseq`` loads its checkpoint as fairseq
does (read into memory and copied into the model), ours as our plugin does (mapped:
beamplugin.fairseq_plugin.mapped_checkpoints).

Every timing runs in a process of its own that loads only its system (CTranslate2's without
torch), decodes once to warm up, then once timed: in one process the idle threads of one
runtime's pool (torch's OpenMP, CTranslate2's) spin on the cores the other needs, which made
every system slower with 2 threads than with 1. Each round
runs the systems in a shuffled order; the median over rounds is printed, with the CPU's model
name and flags. CTranslate2 is a benchmark-only dependency: ``pip install -e '.[bench]'``.

On a GPU (``--device cuda``, ``--precision float32|fp16|bf16``) fairseq's generator and ours
(streamed and ``generate``) decode the same weights cast to that precision on the device;
CTranslate2 and ``--int8`` are left out (the CTranslate2 we pin is timed on the CPU).

Each worker inherits the environment: ``BEAMPLUGIN_ISA=avx2`` pins our AVX2 kernels,
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` holds torch's (fairseq's) to AVX2 and
``CT2_FORCE_CPU_ISA=AVX2`` CTranslate2's, as on a CPU without AVX-512.

On an fconv or convs2s model a second part follows in this process: fairseq's generator and
ours interleaved on fairseq's fconv and our convs2s, and where our generator's time goes
(forwards, reorders, bookkeeping by part, tensor operations a step; host synchronisations on
CUDA): benchmarks/in_process.py. ``--random`` runs that part alone, on a random
fconv_iwslt_de_en-shaped model of 8k words (``make bench``).

``--results FILE`` appends a record a system, batch size and thread count (the row
``LABEL-bBATCH``, ``--label``: the checkpoint's name by default); ``--max-sentences N`` times N
sentences at every batch size (``--sentences`` and ``--batch-1-sentences`` at once).

    python -m benchmarks.generate --path CHECKPOINT --data DATA_BIN \\
        --sentences 256 --batch-sizes 1 64 --threads 1 2
    python -m benchmarks.generate --random --batch-sizes 1 64 --threads 1
    python -m benchmarks.generate --device cuda --path CKPT.pt --data DATA-BIN --batch-sizes 64 \\
        --max-sentences 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_results_option,
    append_records,
    command_line,
    cpu_description,
    in_own_process,
    machine,
    peak_resident_mib,
    record,
    table_name,
)

BEAM, MAX_LEN_B = 5, 200
SYSTEMS = ["fairseq", "ours", "ours int8", "ours bf16", "ours generate", "ours torch kernels",
           "ct2 float32", "ct2 int8"]  # fmt: skip
# with --vocabulary-map: ours and CTranslate2 on a shortlist (CTranslate2's use_vmap)
SHORTLISTED = ["ours vmap", "ours int8 vmap", "ct2 float32 vmap", "ct2 int8 vmap"]
OURS_STREAMED = ("ours", "ours int8", "ours bf16", "ours torch kernels", "ours vmap",
                 "ours int8 vmap")  # fmt: skip


def system_precision(system: str, default: str) -> str:
    """The reduced precision a system's name asks for ("ours int8", "ours bf16"), else
    ``default``."""
    return next((p for p in ("int8", "bf16") if p in system), default)


def test_set_options(parser: argparse.ArgumentParser) -> None:
    """Which sentences are decoded, in batches of which sizes (this script's and its siblings')."""
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])


def timing_options(parser: argparse.ArgumentParser, max_len_b: int) -> None:
    """The options of :func:`measure` beyond the test set: shared with model_sizes.py,
    whose random models decode to ``--max-len-b`` (its default differs from ours)."""
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--batch-1-sentences", type=int, default=60,
                        help="sentences timed at batch size 1 (it is slow for fairseq)")
    parser.add_argument("--max-len-b", type=int, default=max_len_b,
                        help="longest hypothesis in tokens before EOS (max_len_a is 0)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS + SHORTLISTED,
                        default=SYSTEMS + SHORTLISTED,
                        help="which to time (fairseq always: the others are set against it)")
    parser.add_argument("--vocabulary-map", type=Path,
                        help="a vocabulary map (CTranslate2's format): adds the systems "
                        f"{', '.join(SHORTLISTED)}, which decode on each sentence's shortlist")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda: on cuda fairseq's and our float systems alone "
                        "(CTranslate2 is installed for the CPU; --int8 is the CPU's)")
    parser.add_argument("--precision", choices=["float32", "fp16", "bf16"], default="float32",
                        help="the dtype fairseq's and our models decode in ('ours int8' "
                        "multiplies in int8 on float32 models)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="a fairseq checkpoint (transformer, fconv or convs2s)")
    parser.add_argument("--data", help="its binarized data directory")
    parser.add_argument("--random", action="store_true",
                        help="a random fconv_iwslt_de_en-shaped model, in this process alone")
    parser.add_argument("--seed", type=int, default=1, help="of --random's model and sentences")
    parser.add_argument("--label", help="the records' model and row name (default: the "
                        "checkpoint's file name, or random-fconv)")
    parser.add_argument("--max-sentences", type=int,
                        help="sentences timed at every batch size")
    test_set_options(parser)
    timing_options(parser, MAX_LEN_B)
    add_results_option(parser)
    parser.add_argument("--worker", choices=SYSTEMS + SHORTLISTED, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.random and not (args.path and args.data):
        parser.error("give --path and --data, or --random")
    if args.max_sentences:
        args.sentences = args.batch_1_sentences = args.max_sentences
    args.label = args.label or ("random-fconv" if args.random else Path(args.path).stem)
    return args


def ct2_model(
    path: str, data: str, quantization: str | None, workdir: Path, vmap: Path | None = None
) -> Path:
    out = workdir / f"ct2-{quantization or 'float32'}{'-vmap' if vmap else ''}"
    # ct2-fairseq-converter, after beamplugin made fairseq's checkpoint loading work under
    # torch's weights_only unpickler (and registered the task the checkpoint may name)
    convert = "import sys, beamplugin; from ctranslate2.converters.fairseq import main; main()"
    command = [sys.executable, "-c", convert, "--model_path", path, "--data_dir", data,
               "--output_dir", str(out)]
    if quantization:
        command += ["--quantization", quantization]
    if vmap:
        command += ["--vocab_mapping", str(vmap)]
    subprocess.run(command, check=True, capture_output=True)
    return out


# ---- a worker: one system, one thread count, one batch size, one timed decode ----------------


def worker(args: argparse.Namespace) -> None:
    """Decode the job's sentences twice with ``args.worker``, print as JSON the second's seconds,
    its best hypotheses (token ids for fairseq and ours, words for CTranslate2), the seconds from
    loading the model to ready to decode (the runtime's imports excluded, the warm-up decode
    not included: what lazily happens there is not counted) and the process's peak resident
    memory (the model, its runtime and the decodes' buffers)."""
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    if args.worker.startswith("ct2"):
        decode, load_seconds = ct2_decoder(job, args.worker.removeprefix("ct2 "), job["threads"])
    else:
        decode, load_seconds = torch_decoder(args, job)
    decode()
    start = time.perf_counter()
    best = decode()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "best": best, "load_seconds": load_seconds,
                      "peak_rss_mib": peak_resident_mib()}))


def ct2_decoder(job: dict[str, Any], kind: str, threads: int) -> tuple[Any, float]:
    """CTranslate2's decode of the job's sentences (``kind``: "float32" or "int8", then "vmap"
    for its shortlist), and the seconds its model took to load."""
    import ctranslate2  # the only runtime in this process

    started = time.perf_counter()
    translator = ctranslate2.Translator(
        job["ct2"][kind], device="cpu", compute_type=kind.split()[0],
        intra_threads=threads, inter_threads=1,
    )  # fmt: skip
    loaded = time.perf_counter() - started

    def decode() -> list[list[str]]:
        results = translator.translate_batch(
            job["words"], beam_size=BEAM, max_batch_size=job["batch"], length_penalty=1.0,
            max_decoding_length=ct2_decoding_length(job["max_len_b"]), return_scores=False,
            use_vmap=kind.endswith("vmap"),
        )  # fmt: skip
        return [r.hypotheses[0] for r in results]

    return decode, loaded


def ct2_decoding_length(max_len_b: int) -> int:
    """CTranslate2's max_decoding_length that decodes as many steps as fairseq's max_len_b (and
    max_len_a 0): fairseq decodes up to max_len_b tokens and then one more step whose token is
    forced to EOS, CTranslate2 stops after max_decoding_length steps whatever their tokens."""
    return max_len_b + 1


def torch_decoder(args: argparse.Namespace, job: dict[str, Any]) -> tuple[Any, float]:
    """fairseq's or our decode of the job's sentences (as ``args.worker`` names), and the seconds
    from loading the checkpoint to the generator built."""
    if args.worker == "fairseq":  # first, as fairseq-generate imports it (scikit-learn too)
        import fairseq  # noqa: F401
    import beamplugin  # noqa: F401  (as our entry points import fairseq: no scikit-learn)

    # isort: split
    import torch
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

    from beamplugin import SequenceGenerator
    from beamplugin.fairseq_plugin.precision import cast_for_decoding
    from beamplugin.search.vocabulary_map import VocabularyMap
    from beamplugin.streams.translate import translate
    from benchmarks.models import checkpoint_models, prepare

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    model = models[0].eval()
    if convolutional(model):  # fairseq's fconv against our convs2s, the same weights
        fconv, convs2s, _ = checkpoint_models(args.path, args.data)
        model = prepare(fconv, BEAM) if args.worker == "fairseq" else convs2s
    device = torch.device(job["device"])
    model.to(device)
    precision = system_precision(args.worker, job["precision"])
    if precision != "float32":
        cast_for_decoding([model], precision)
    options: dict[str, Any] = dict(beam_size=BEAM, max_len_a=0, max_len_b=job["max_len_b"])
    if args.worker.endswith("vmap"):  # the shortlist as task beam_translation reads it
        target = task.target_dictionary
        special = [target.bos(), target.pad(), target.eos(), target.unk()]
        options["shortlist"] = VocabularyMap.read(job["vocabulary_map"],
                                                  task.source_dictionary.indices,
                                                  target.indices, special)  # fmt: skip
    streams = args.worker in OURS_STREAMED
    if streams:  # as task beam_translation builds it without --print-alignment, --nbest 1
        options.update(attention=False, nbest=1)
    kind = FairseqGenerator if args.worker == "fairseq" else SequenceGenerator
    generator = kind([model], task.target_dictionary, **options)
    loaded = time.perf_counter() - started
    pad, batch = task.source_dictionary.pad(), job["batch"]
    sources = [torch.tensor(s, device=device) for s in job["sources"]]

    def streamed() -> list[list[int]]:
        results = translate(generator, sources, max_sentences=batch, ordered=True)
        return [hypotheses[0]["tokens"].tolist() for _, hypotheses in results]

    def decode() -> list[list[int]]:
        best = []
        for first in range(0, len(sources), batch):
            group = sources[first : first + batch]
            width = max(len(s) for s in group)
            tokens = torch.full((len(group), width), pad, dtype=torch.long, device=device)
            for row, s in enumerate(group):
                tokens[row, width - len(s) :] = s
            lengths = torch.tensor([len(s) for s in group], device=device)
            sample = {"net_input": {"src_tokens": tokens, "src_lengths": lengths}}
            with torch.inference_mode():
                out = generator.generate([model], sample)
            best.extend(hypos[0]["tokens"].tolist() for hypos in out)
        return best

    return (streamed if streams else decode), loaded


# ---- the run: workers in turns, the table ------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if not args.random and not measure(args.path, args.data, args):
        return  # a transformer: nothing to set fconv against
    if args.precision != "float32":
        print("# in one process: float32 alone (see --precision)")
        return
    from benchmarks import in_process  # torch and fairseq: not in a CTranslate2 worker

    for threads in args.threads:
        figures = in_process.compare(args, threads, BEAM)
        append_records(args.results, [
            record(table=table_name(args.device), row=f"{args.label}-in-process-b{f['batch']}"
                   + ("" if threads == 1 else f"-t{threads}"),
                   what=f"{args.label}: fairseq's fconv and ours in one process",
                   system=f["system"], model=args.label, precision="float32", batch=f["batch"],
                   sentences_per_s=f["sentences"] / f["seconds"],
                   tokens_per_s=f["tokens"] / f["seconds"], same_as_reference=f["same"],
                   command=command_line(), **machine(args.device, threads))
            for f in figures
        ])  # fmt: skip


def measure(path: str, data: str, options: argparse.Namespace) -> bool:
    """Time every system on checkpoint ``path`` (data directory ``data``), print a table per
    thread count and batch size and append their records to ``options.results``; whether the
    model is an fconv or a convs2s. ``options`` holds those of :func:`test_set_options`,
    :func:`timing_options` and ``--results`` and ``--label`` (model_sizes.py calls this on the
    models it builds)."""
    import torch
    from fairseq import checkpoint_utils

    import beamplugin  # noqa: F401  (registers the task, safe checkpoint loading)
    from beamplugin.fairseq_plugin.precision import native_on_cpu

    if options.device == "cpu" and options.precision != "float32":
        raise SystemExit("--precision: fp16 and bf16 are timed on a GPU (--device cuda); on the "
                         "CPU the systems 'ours int8' and 'ours bf16' are the reduced precisions")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data}
    )
    transformer = not convolutional(models[0])
    del models  # the workers load their own: not this process's gigabytes meanwhile
    dictionary, eos = task.target_dictionary, task.target_dictionary.eos()
    task.load_dataset(options.gen_subset)
    dataset = task.dataset(options.gen_subset)
    items = sorted((dataset[i] for i in range(min(options.sentences, len(dataset)))),
                   key=lambda item: len(item["source"]))
    sources = [item["source"].tolist() for item in items]
    references = [dictionary.string(item["target"], "sentencepiece") for item in items]
    # the converted models and the jobs: gigabytes at real sizes, removed at the end
    with tempfile.TemporaryDirectory(prefix="bench-transformer-") as scratch:
        workdir = Path(scratch)
        systems = [s for s in SYSTEMS if not s.startswith("ct2")]
        ct2: dict[str, str] = {}
        try:
            import ctranslate2  # noqa: F401

            if transformer:
                vmap = options.vocabulary_map
                kinds = [(kind, None) for kind in ("float32", "int8")]
                kinds += [(kind, vmap) for kind in ("float32", "int8") if vmap]
                ct2 = {f"{kind}{' vmap' if shortlist else ''}": str(ct2_model(
                    path, data, None if kind == "float32" else kind, workdir, shortlist))
                    for kind, shortlist in kinds}  # fmt: skip
                systems = SYSTEMS + (SHORTLISTED if vmap else [])
        except ImportError:
            print("# ctranslate2 is not installed (pip install -e '.[bench]'): without CTranslate2")
        if options.vocabulary_map and not ct2:  # ours alone (CTranslate2 absent, or a ConvS2S)
            systems += SHORTLISTED[:2]
        # at real sizes a round takes minutes a system: the ones asked for, fairseq always
        systems = [s for s in systems if s in options.systems or s == "fairseq"]
        if "ours bf16" in systems and not native_on_cpu(torch.bfloat16):
            print("# ours bf16 left out: this CPU has no bfloat16 products (--bf16 decodes in "
                  "float32 here)")
            systems.remove("ours bf16")
        where = cpu_description()
        if options.device != "cpu":  # fairseq's and our float systems in the asked precision
            systems = [s for s in systems if s in ("fairseq", "ours", "ours generate")]
            where = f"{torch.cuda.get_device_name(options.device)} ({options.precision}); {where}"
        print(f"# {path}; beam {BEAM}, max_len_a 0, max_len_b {options.max_len_b}; "
              f"{where}; torch {torch.__version__}; each timing in a process of its own")
        rng = random.Random(1)
        for threads in options.threads:
            for batch in options.batch_sizes:
                count = len(sources) if batch > 1 else min(options.batch_1_sentences, len(sources))
                job = workdir / f"job-{threads}-{batch}.json"
                job.write_text(json.dumps({
                    "threads": threads, "batch": batch, "sources": sources[:count], "ct2": ct2,
                    "words": [[dictionary[t] for t in s if t != eos] for s in sources[:count]],
                    "max_len_b": options.max_len_b,
                    "device": options.device, "precision": options.precision,
                    "vocabulary_map": str(options.vocabulary_map or ""),
                }), encoding="utf-8")  # fmt: skip
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
                outputs: dict[str, list[list[int]]] = {}
                for _ in range(options.repeats):
                    for name in rng.sample(systems, len(systems)):
                        result = run_worker(path, data, name, job)
                        runs[name].append(result)
                        outputs[name] = (
                            ct2_tokens(result["best"], dictionary, options.max_len_b)
                            if name.startswith("ct2") else result["best"]
                        )
                rows = report(threads, batch, count, runs, outputs, references, dictionary)
                append_records(options.results, [
                    record(table=table_name(options.device),
                           row=f"{options.label}-b{batch}" + ("" if threads == 1 else
                                                              f"-t{threads}"),
                           what=f"{options.label}: {path}", model=options.label, batch=batch,
                           precision=system_precision(row["system"], options.precision),
                           command=command_line(), **row, **machine(options.device, threads))
                    for row in rows
                ])  # fmt: skip
    return not transformer


def ct2_tokens(best: list[list[str]], dictionary: Any, max_len_b: int) -> list[list[int]]:
    """CTranslate2's best hypotheses as fairseq's tokens: ended by EOS (which CTranslate2 leaves
    out), those that reached the length limit without their last word (which stands where
    fairseq's forced EOS does: see :func:`ct2_decoding_length`)."""
    return [[dictionary.index(w) for w in h[:max_len_b]] + [dictionary.eos()] for h in best]


def convolutional(model: Any) -> bool:
    """Whether ``model`` is an fconv or a convs2s (else a transformer)."""
    from fairseq.models.fconv import FConvModel

    from beamplugin.models.convs2s import ConvS2SModel

    return isinstance(model, FConvModel | ConvS2SModel)


def run_worker(path: str, data: str, name: str, job: Path) -> dict[str, Any]:
    """One timed decode by system ``name`` in a process of its own: :func:`worker`'s JSON."""
    env = {"BEAMPLUGIN_ISA": "off"} if name == "ours torch kernels" else None
    if name == "fairseq":  # fairseq's own loading (a copy of the checkpoint), as without us
        env = {"BEAMPLUGIN_MMAP": "0"}
    lines = in_own_process(__spec__.name, "--path", path, "--data", data, "--worker", name,
                   "--job", str(job), env=env)  # fmt: skip
    return json.loads(lines[-1])


def report(threads: int, batch: int, count: int, runs: dict[str, list[dict[str, Any]]],
           outputs: dict[str, list[list[int]]], references: list[str],
           dictionary: Any) -> list[dict[str, Any]]:
    """One table: per system the medians over rounds of its speed (sentences/s, and tokens/s
    counting each best hypothesis's tokens with its EOS, one decoder step each) and load time,
    its speed against fairseq's and CTranslate2's, its best hypotheses against fairseq's, BLEU,
    and the largest peak resident memory of its rounds; and those figures, a record's fields a
    system."""
    import sacrebleu
    import torch

    median = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    base = median["fairseq"]
    ct2, ct2_int8 = median.get("ct2 float32"), median.get("ct2 int8")
    print(f"\n## {threads} thread(s), batch {batch}: {count} sentences, "
          f"median of {len(next(iter(runs.values())))} rounds; tok/s: output tokens of the best "
          "hypotheses, EOS included")
    against = "  x ct2 f32  x ct2 int8" if ct2 and ct2_int8 else ""
    print(f"{'system':18s}  sent/s    tok/s  x fairseq{against}  same best  BLEU  "
          "peak MiB  load s")
    rows = []
    for name, time_taken in median.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs["fairseq"], strict=True))
        tokens = sum(len(h) for h in outputs[name])
        text = [dictionary.string(torch.tensor(h), "sentencepiece") for h in outputs[name]]
        bleu = sacrebleu.corpus_bleu(text, [references[: len(text)]]).score
        against_ct2 = (f"  {ct2 / time_taken:9.2f}  {ct2_int8 / time_taken:10.2f}"
                       if ct2 and ct2_int8 else "")
        load = statistics.median(r["load_seconds"] for r in runs[name])
        peaks = [r["peak_rss_mib"] for r in runs[name] if r["peak_rss_mib"] is not None]
        peak = f"{max(peaks):9.0f}" if peaks else f"{'-':>9s}"
        print(f"{name:18s} {count / time_taken:7.1f} {tokens / time_taken:8.1f} "
              f"{base / time_taken:10.2f}{against_ct2}  {same:4d}/{count:<4d} {bleu:5.2f} "
              f"{peak} {load:7.2f}")
        rows.append(dict(system=name, sentences_per_s=count / time_taken,
                         tokens_per_s=tokens / time_taken, same_as_reference=f"{same}/{count}",
                         bleu=bleu, peak_mib=max(peaks) if peaks else None))  # fmt: skip
        if name == "ours bf16" and "ours" in median:  # bfloat16's gain: against our float32
            rows[-1]["ratio"] = dict(against="ours", value=median["ours"] / time_taken)
            print(f"{'':18s} x{median['ours'] / time_taken:.2f} ours (float32)")
    return rows


if __name__ == "__main__":
    main()

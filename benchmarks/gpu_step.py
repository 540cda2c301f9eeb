"""The device engine on a GPU against fairseq's generator and our other engine, side by side in
one run, on fairseq transformers of the sizes people deploy (random weights, built here: a
random model rarely ends a hypothesis early, so every sentence takes ``--max-len-b`` + 1 steps)
and the checks of its bits: each sentence alone = batched = in another bucket, in every
precision, and whether cuBLAS gives a row the same bits whatever the rows beside it.

Systems: ``fairseq`` (fairseq's SequenceGenerator), ``ours`` (beamplugin's engine of
beamplugin.engine.engine), ``device`` (the device engine, eager steps) and ``graphs`` (the
device engine, its steps replayed as CUDA graphs). Each decodes the same sentences in static
batches (``generate``) after a warm-up pass; rounds interleave the systems. Prints a markdown
table and writes one JSON line a row (``--results``, the schema of benchmarks/results).

    python -m benchmarks.gpu_step --models base big --batch-sizes 1 64 --precision fp16
    python -m benchmarks.gpu_step --models tiny --batch-sizes 1 8 --device cpu  # smoke
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import (
    TransformerModel,
    transformer_vaswani_wmt_en_de_big,
    transformer_wmt_en_de,
)
from fairseq.models.transformer import base_architecture as transformer_base
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

import beamplugin  # noqa: F401  (registers the task and model)
from beamplugin import SequenceGenerator
from beamplugin.models.convs2s import ConvS2SModel
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

SHAPES = {  # architecture, words ("convs2s": the demo's convs2s_iwslt_de_en shape, 8k words)
    "convs2s": (None, 8000),
    "tiny": (None, 1024),
    "base": (transformer_wmt_en_de, 32768),
    "big": (transformer_vaswani_wmt_en_de_big, 32768),
}
DTYPES = {"float32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SYSTEMS = ("fairseq", "ours", "device", "graphs")


class _Task:
    def __init__(self, d: Dictionary) -> None:
        self.source_dictionary = self.target_dictionary = d


def build(name: str, seed: int = 1) -> tuple[TransformerModel, Dictionary]:
    """A fairseq transformer of shape ``name`` with fairseq's random initialisation."""
    arch, words = SHAPES[name]
    d = Dictionary()
    for i in range(words - d.nspecial):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    args = argparse.Namespace(share_all_embeddings=True, dropout=0.0,
                              max_source_positions=1024, max_target_positions=1024)  # fmt: skip
    if arch is None:  # tiny: 2+2 x 64
        for side in ("encoder", "decoder"):
            setattr(args, f"{side}_embed_dim", 64)
            setattr(args, f"{side}_ffn_embed_dim", 128)
            setattr(args, f"{side}_layers", 2)
            setattr(args, f"{side}_attention_heads", 4)
        transformer_base(args)
    else:
        arch(args)
    torch.manual_seed(seed)
    return TransformerModel.build_model(args, _Task(d)).eval(), d


def build_convs2s(beam: int) -> tuple[Any, Any, Dictionary]:
    """fairseq's fconv (prepared as fairseq-generate prepares it) and our convs2s with the same
    random weights of the demo's shape, sharpened so that outputs end at varied lengths."""

    fconv, d, model_args = random_fconv(SHAPES["convs2s"][1], seed=1)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    convs2s = same_weights(ConvS2SModel, fconv, model_args, task, "fconv")
    fconv.make_generation_fast_(beamable_mm_beam_size=beam)
    return fconv, convs2s, d


def sentences(d: Dictionary, count: int, seed: int = 2) -> list[torch.Tensor]:
    """``count`` random sentences of 8 to 40 words, each ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(8, 41, (1,), generator=g))
        words = torch.randint(d.nspecial, len(d), (n,), generator=g)
        out.append(torch.cat([words, torch.tensor([d.eos()])]))
    return out


def batch_of(items: list[torch.Tensor], d: Dictionary, device: str) -> dict:
    width = max(len(s) for s in items)
    src = torch.full((len(items), width), d.pad(), dtype=torch.long)
    for i, s in enumerate(items):
        src[i, width - len(s) :] = s
    lengths = torch.tensor([len(s) for s in items])
    return {"net_input": {"src_tokens": src.to(device), "src_lengths": lengths.to(device)}}


def generator(system: str, model: Any, d: Dictionary, beam: int, max_len_b: int) -> Any:
    options = dict(beam_size=beam, max_len_b=max_len_b, max_len_a=0)
    if system == "fairseq":
        return FairseqGenerator([model], d, **options)
    engine = {"ours": "off", "device": "on", "graphs": "on"}[system]
    return SequenceGenerator([model], d, attention=False, device_engine=engine,
                             cuda_graphs=system == "graphs", **options)  # fmt: skip


def decode(gen: Any, model: Any, batches: list[dict]) -> tuple[float, list[list[int]], int]:
    """Seconds, best hypotheses, output tokens (EOS included)."""
    sync()
    started = time.perf_counter()
    best, tokens = [], 0
    with torch.inference_mode():
        for sample in batches:
            for hypos in gen.generate([model], sample):
                best.append(hypos[0]["tokens"].tolist())
                tokens += len(hypos[0]["tokens"])
    sync()
    return time.perf_counter() - started, best, tokens


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_share(gen: Any, model: Any, batches: list[dict], tables: Path | None, title: str
               ) -> float | None:  # fmt: skip
    """Seconds of GPU kernels in one pass (torch's profiler; its own overhead makes the pass's
    wall time meaningless, so the caller sets them against an unprofiled pass); with
    ``tables``, its tables appended there."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(gen, model, batches)
    wall = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in kernels) / 1e6
    if tables is not None:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        with tables.open("a") as f:
            f.write(f"## {title}: wall {wall * 1000:.1f} ms, kernels {busy * 1000:.1f} ms, "
                    f"{len(kernels)} kernel launches\n{table}\n")  # fmt: skip
    return busy


def row_invariance(device: str) -> list[dict]:
    """Whether F.linear gives row 0 the same bits with 5 rows as with more, per dtype, with
    torch's defaults and, on a GPU, without reduced-precision reductions and on cuBLASLt."""
    settings = [("defaults", lambda: None)]
    if device == "cuda":
        matmul = torch.backends.cuda.matmul

        def full_precision_sums() -> None:
            matmul.allow_fp16_reduced_precision_reduction = False
            matmul.allow_bf16_reduced_precision_reduction = False

        settings += [("no reduced-precision sums", full_precision_sums),
                     ("cuBLASLt", lambda: torch.backends.cuda.preferred_blas_library("cublaslt"))]
    results = []
    for setting, apply in settings:
        apply()
        g = torch.Generator().manual_seed(3)
        for dtype_name, dtype in DTYPES.items():
            for k, n in ((512, 1536), (512, 32768), (1024, 4096)):
                w = torch.randn(n, k, generator=g).to(device, dtype)
                x = torch.randn(640, k, generator=g).to(device, dtype)
                alone = torch.nn.functional.linear(x[:5], w)
                same = all(
                    torch.equal(alone, torch.nn.functional.linear(x[:m], w)[:5])
                    for m in (10, 20, 40, 80, 160, 320, 640)
                )
                results.append({"setting": setting, "dtype": dtype_name, "k": k, "n": n,
                                "same": same})  # fmt: skip
    if device == "cuda":  # back to torch's defaults for what follows
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        torch.backends.cuda.preferred_blas_library("cublas")
    return results


def bits_check(model_name: str, precision: str, device: str, beam: int, count: int) -> dict:
    """The device engine: each sentence alone (bucket 1), in a static batch and in a stream of
    capacity 4 (sentences joining mid-search, other buckets), graphs and not: the same bits."""
    from beamplugin.engine import open_engine  # noqa: PLC0415
    from beamplugin.streams import IteratorSource, run, sentence_request  # noqa: PLC0415

    model, d = build(model_name)
    model = model.to(device, DTYPES[precision])
    items = sentences(d, count, seed=5)
    out = {}
    for graphs in (False, True):
        gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=12, attention=False,
                                device_engine="on", cuda_graphs=graphs)  # fmt: skip
        with torch.inference_mode():
            alone = [gen.generate([model], batch_of([s], d, device))[0] for s in items]
            batched = gen.generate([model], batch_of(items, d, device))
            engine = open_engine(gen.model, gen.options, max_sentences=4)
            requests = [sentence_request(i, s.to(device), None) for i, s in enumerate(items)]
            streamed = {f.key: f.hypotheses for f in run(engine, IteratorSource(requests))}
        out[graphs] = alone
        same = all(
            _identical(a, b) and _identical(a, streamed[i])
            for i, (a, b) in enumerate(zip(alone, batched, strict=True))
        )
        out[f"same{graphs}"] = same
    graphs_same = all(_identical(a, b) for a, b in zip(out[False], out[True], strict=True))
    return {"model": model_name, "precision": precision, "alone_batched_streamed": out["sameFalse"],
            "with_graphs": out["sameTrue"], "graphs_eq_eager": graphs_same}  # fmt: skip


def _identical(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x["tokens"].tolist() == y["tokens"].tolist()
        and torch.equal(x["score"], y["score"])
        and torch.equal(x["positional_scores"], y["positional_scores"])
        for x, y in zip(a, b, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=["base", "big"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--precision", choices=list(DTYPES), default="fp16")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--max-len-b", type=int, default=40)
    parser.add_argument("--sentences", type=int, default=256, help="at batch sizes above 1")
    parser.add_argument("--batch-1-sentences", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", action="store_true", help="bits and cuBLAS checks first")
    add_results_option(parser)
    parser.add_argument("--profile", type=Path,
                        help="write torch's profile of one batch of each system here")
    args = parser.parse_args()
    info = machine(args.device, torch.get_num_threads())
    command = command_line()
    print(f"# {info['device']} (host {info['host_cpu']}), torch {torch.__version__}, "
          f"commit {info['commit']}; {cpu_description()}", flush=True)  # fmt: skip
    if args.checks:
        for row in row_invariance(args.device):
            print("cuBLAS/F.linear row 0 same bits with 5..640 rows:", row, flush=True)
        for precision in DTYPES:
            print("device engine bits:", bits_check("tiny", precision, args.device, 4, 12),
                  flush=True)  # fmt: skip
    rows = []
    for name in args.models:
        fairseqs = None  # the model fairseq's generator decodes, where it is another
        if name == "convs2s":
            fairseqs, model, d = build_convs2s(args.beam)
            fairseqs = fairseqs.to(args.device, DTYPES[args.precision])
        else:
            model, d = build(name)
        model = model.to(args.device, DTYPES[args.precision])
        for batch in args.batch_sizes:
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            count = args.batch_1_sentences if batch == 1 else args.sentences
            items = sentences(d, count)
            batches = [batch_of(items[i : i + batch], d, args.device)
                       for i in range(0, count, batch)]  # fmt: skip
            # a model each: fairseq's forwards make our prepared weights (and graphs) anew
            models = {s: copy.deepcopy(fairseqs if s == "fairseq" and fairseqs else model)
                      for s in args.systems}  # fmt: skip
            gens = {s: generator(s, models[s], d, args.beam, args.max_len_b)
                    for s in args.systems}  # fmt: skip
            times: dict[str, list[float]] = {s: [] for s in args.systems}
            best: dict[str, list[list[int]]] = {}
            tokens: dict[str, int] = {}
            # warm-up: kernels, weights prepared, a graph for each bucket (at batch 1 the
            # sentences' widths make others: all of them first)
            warm = batches if batch == 1 else batches[:2]
            for system, gen in gens.items():
                decode(gen, models[system], warm)
            for _ in range(args.rounds):
                for system, gen in gens.items():
                    seconds, best[system], tokens[system] = decode(gen, models[system], batches)
                    times[system].append(seconds)
            # a random transformer's hypotheses run to the maximum length; the convs2s is
            # sharpened to end them earlier, so its steps are not counted
            steps = args.max_len_b + 1 if name != "convs2s" else None
            reference = best.get("fairseq")
            for system in args.systems:
                seconds = statistics.median(times[system])
                kernels = busy_share(gens[system], models[system], batches[:1], args.profile,
                                     f"{name} {args.precision} batch {batch} {system}")
                gpu_ms = None if kernels is None or steps is None else 1000 * kernels / steps
                ms = None if steps is None else 1000 * seconds / (len(batches) * steps)
                same = (
                    sum(a == b for a, b in zip(reference, best[system], strict=True))
                    if reference else None
                )  # fmt: skip
                row = record(
                    table=table_name(args.device), row=f"{name}-{args.precision}-b{batch}",
                    what=f"{_model_name(name)}, {args.precision}, batch {batch}",
                    system={"graphs": "ours graphs", "device": "ours no graphs",
                            "ours": "ours (other engine)"}.get(system, system),
                    model=_model_name(name), precision=args.precision, batch=batch,
                    sentences_per_s=count / seconds, tokens_per_s=tokens[system] / seconds,
                    ms_per_step=ms, gpu_ms_per_step=gpu_ms,
                    gpu_busy=None if gpu_ms is None else min(1.0, gpu_ms / ms),
                    gpu_ms_per_sentence=None if kernels is None else 1000 * kernels / batch,
                    ratio=None if "fairseq" not in times else {
                        "against": "fairseq",
                        "value": statistics.median(times["fairseq"]) / seconds},
                    same_as_reference=None if same is None else f"{same}/{count}",
                    command=command, **info,
                )  # fmt: skip
                rows.append(row)
                print(_line(row), flush=True)
                append_records(args.results, [row])
    print()
    print("| model | batch | system | ms a step | tokens/s | x fairseq | GPU busy | as fairseq |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(_line(row))


def _model_name(name: str) -> str:
    return "convs2s random (demo shape)" if name == "convs2s" else f"transformer {name}"


def _line(row: dict) -> str:
    ratio = row["ratio"]["value"] if row["ratio"] else None
    busy = row["gpu_busy"]
    ms = row["ms_per_step"]
    return (
        f"| {row['model']} {row['precision']} | {row['batch']} | {row['system']} | "
        f"{'' if ms is None else f'{ms:.3f}'} | {row['tokens_per_s']:.0f} | "
        f"{'' if ratio is None else f'x{ratio:.2f}'} | "
        f"{'' if busy is None else f'{100 * busy:.0f}%'} | {row['same_as_reference'] or ''} |"
    )


if __name__ == "__main__":
    main()

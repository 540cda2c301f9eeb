"""Time beamplugin's generator against fairseq's, on the same checkpoint and sentences.

Three systems, run interleaved (one pass over all batches each, in turn, ``--repeats`` times):

* ``fairseq``: fairseq's fconv + fairseq's SequenceGenerator (the baseline);
* ``ours/fconv``: the same fconv + our SequenceGenerator: (a) the generator alone;
* ``ours/convs2s``: our convs2s (the same weights loaded into it) + our generator:
  (b) end to end.

``--path`` takes an fconv or a convs2s checkpoint (``make demo`` trains one): the two models have
the same parameters, so each gets the checkpoint's weights.

Each model is prepared as fairseq-generate prepares it (``eval()``, ``prepare_for_inference_``:
weight norm removed, BeamableMM in fconv, no attention kept). Prints the median time per system,
the median speed-up against fairseq, whether the outputs agree (tokens of every hypothesis, scores
within 1e-4), and, from a separate instrumented pass, where the time goes: model forwards
(encoder and decoder steps), reordering of the decoder states / encoder output, and the rest
(search bookkeeping); and how many tensor operations our generator makes per decoder step outside
the forwards, by part (on small batches their number, not their size, sets that time).

    python scripts/bench_generate.py --path ckpt/checkpoint_best.pt --data data-bin \\
        --batch-sizes 1 64 --beam 5 --threads 2 --max-sentences 200
    python scripts/bench_generate.py --random   # fconv_iwslt_de_en shape, 8k vocabulary

With ``--device cuda`` the models and batches live on the GPU, each timed pass ends with a
``torch.cuda.synchronize()``, and a further pass under ``torch.cuda.set_sync_debug_mode`` counts
the host synchronisations per decoder step of each system. The instrumented split synchronises
around each forward on CUDA (else kernel launches, not kernels, would be timed).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch
from fairseq import checkpoint_utils, utils
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.fconv import FConvModel
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from torch.utils._python_dispatch import TorchDispatchMode

import beamplugin  # noqa: F401  (registers convs2s, safe checkpoint loading)
import beamplugin.engine.engine as engine_module
from beamplugin.engine.ensemble import ReorderedMemory
from beamplugin.engine.finalizer import Finalizer
from beamplugin.engine.model_runner import ModelRunner
from beamplugin.engine.slots import Slots
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.kernels import instruction_sets, native_library
from beamplugin.models.convs2s import ConvS2SModel
from beamplugin.modules import MemoryPool
from beamplugin.search.log_prob_rules import LogProbRules

Batch = dict[str, Any]


def parse_args() -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="an fconv or convs2s checkpoint (both models get it)")
    parser.add_argument("--data", help="binarized data dir of the checkpoint")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--random", action="store_true", help="random fconv_iwslt_de_en model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--lenpen", type=float, default=1.0)
    parser.add_argument("--max-len-b", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    parser.add_argument("--max-sentences", type=int, default=128, help="sentences timed")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not args.random and not (args.path and args.data):
        parser.error("give --path and --data, or --random")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    return args


# ---------------------------------------------------------------------------------------------
# models and sentences


def random_fconv(vocab_size: int, seed: int) -> tuple[FConvModel, Dictionary, Namespace]:
    """An fconv_iwslt_de_en-shaped model with random weights, sharpened so that outputs end at
    varied lengths (a random model otherwise rambles on to max length)."""
    dictionary = Dictionary()
    for index in range(vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{index}")
    dictionary.finalize(padding_factor=8)
    args = Namespace(max_source_positions=1024, max_target_positions=1024, arch="fconv_iwslt_de_en")
    ARCH_CONFIG_REGISTRY["fconv_iwslt_de_en"](args)
    task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(seed)
    model = FConvModel.build_model(args, task)
    with torch.no_grad():
        model.decoder.fc3.weight_g.mul_(10)
        model.decoder.fc3.bias[dictionary.eos()] += 4.5
    return model.eval(), dictionary, args


def random_batches(dictionary: Dictionary, n: int, batch_size: int, seed: int) -> list[Batch]:
    """IWSLT-like source lengths (5 to 40 words), left-padded and ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    sentences = [
        torch.cat(
            [
                torch.randint(dictionary.nspecial, len(dictionary), (int(length),), generator=g),
                torch.tensor([dictionary.eos()]),
            ]
        )
        for length in torch.randint(5, 41, (n,), generator=g)
    ]
    return [collate(sentences[i : i + batch_size], dictionary, i) for i in range(0, n, batch_size)]


def collate(sentences: list[torch.Tensor], dictionary: Dictionary, first_id: int) -> Batch:
    return {
        "id": torch.arange(first_id, first_id + len(sentences)),
        "net_input": {
            "src_tokens": data_utils.collate_tokens(sentences, dictionary.pad(), left_pad=True),
            "src_lengths": torch.tensor([s.numel() for s in sentences]),
        },
    }


def checkpoint_models(path: str, data: str) -> tuple[FConvModel, ConvS2SModel, Any]:
    """fconv and convs2s with the weights of an fconv or a convs2s checkpoint, and its task."""
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data}
    )
    model = models[0]
    if not isinstance(model, FConvModel | ConvS2SModel):
        raise SystemExit(f"{path} holds a {type(model).__name__}, not an fconv/convs2s model")
    args = cfg.model if isinstance(cfg.model, Namespace) else Namespace(**dict(cfg.model))
    args.arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    if isinstance(model, FConvModel):
        return model.eval(), same_weights(ConvS2SModel, model, args, task, "fconv"), task
    return same_weights(FConvModel, model, args, task, "convs2s"), model.eval(), task


def benchmark_models(args: argparse.Namespace) -> tuple[FConvModel, ConvS2SModel, Any, str]:
    """fconv and convs2s with the same weights (``--random`` or ``--path``/``--data``), their
    task (or a stand-in holding the dictionaries), and a description of where they come from."""
    if args.random:
        fconv, dictionary, model_args = random_fconv(8000, args.seed)
        task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
        convs2s = same_weights(ConvS2SModel, fconv, model_args, task, "fconv")
        return fconv, convs2s, task, f"random fconv_iwslt_de_en, {len(dictionary)} words"
    fconv, convs2s, task = checkpoint_models(args.path, args.data)
    return fconv, convs2s, task, f"{args.path} on {args.data}:{args.gen_subset}"


def checkpoint_batches(task: Any, subset: str, n: int, batch_size: int) -> list[Batch]:
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    indices = list(range(min(n, len(dataset))))
    return [
        dataset.collater([dataset[i] for i in indices[start : start + batch_size]])
        for start in range(0, len(indices), batch_size)
    ]


def same_weights(
    model_class: type, source: torch.nn.Module, args: Namespace, task: Any, family: str
) -> torch.nn.Module:
    """A ``model_class`` (fconv or convs2s) with the weights of ``source``, a model of the other
    one: same parameter names and shapes, so a strict load."""
    other = "convs2s" if family == "fconv" else "fconv"
    new_args = Namespace(**vars(args))
    arch = str(args.arch).replace(family, other, 1)
    new_args.arch = arch if arch in ARCH_CONFIG_REGISTRY else other
    ARCH_CONFIG_REGISTRY[new_args.arch](new_args)
    dictionaries = Namespace(
        source_dictionary=task.source_dictionary, target_dictionary=task.target_dictionary
    )
    model = model_class.build_model(new_args, dictionaries)
    model.load_state_dict(source.state_dict(), strict=True)
    return model.eval()


def prepare(model: torch.nn.Module, beam: int) -> torch.nn.Module:
    """As fairseq-generate: BeamableMM for this beam, no attention kept, weight norm folded."""
    cfg = Namespace(generation=Namespace(beam=beam, print_alignment=False, no_beamable_mm=False))
    model.prepare_for_inference_(cfg)  # also puts it in eval mode for good
    return model


# ---------------------------------------------------------------------------------------------
# timing

# The CPU flags that decide which kernels run: float32 FMA width, int8 sums (VNNI, AMX),
# bfloat16 and float16 products.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def cpu_description() -> str:
    """The CPU's model name and kernel flags (Linux's /proc/cpuinfo) and torch's CPU
    capability: printed with every speed figure, which holds only for that CPU."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    present = " ".join(flag for flag in KERNEL_FLAGS if flag in flags) or "flags unknown"
    capability = torch.backends.cpu.get_cpu_capability()
    ours = native_library.built_for("products")
    if ours != "off":
        ours += f", int8 {native_library.built_for('int8_products')}"
        ours += "" if instruction_sets.pinned() else ", each proven against torch's"
    return f"CPU {model} ({present}), torch CPU capability {capability}, our kernels {ours}"



class Timers:
    """Wall time spent inside wrapped methods, by category (and calls, by method)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.cuda = device.type == "cuda"

    def wrap(self, owner: Any, name: str, category: str) -> Callable[[], None]:
        """Time ``owner.name`` (a method of an instance, or a function of a class or module)
        under ``category``; the returned function undoes it."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[category] = self.seconds.get(category, 0.0) + (
                    time.perf_counter() - start
                )
                self.calls[name] = self.calls.get(name, 0) + 1

        return replace(owner, name, timed)


def replace(owner: Any, name: str, replacement: Callable) -> Callable[[], None]:
    """Put ``replacement`` in place of ``owner.name``; the returned function undoes it."""
    own = vars(owner).get(name)  # what to put back: the class's or module's own attribute
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, own) if own is not None else delattr(owner, name)


def instrument(generator: Any, timers: Timers) -> list[Callable[[], None]]:
    model = generator.model
    if isinstance(generator, SequenceGenerator):
        names = {"encode": "forward", "decode_step": "forward", "reorder_states": "reorder"}
        memories = [timers.wrap(m, "rearrange", "reorder") for m in ENCODER_MEMORIES]
    else:
        names = {"forward_encoder": "forward", "forward_decoder": "forward"}
        names |= {"reorder_incremental_state": "reorder", "reorder_encoder_out": "reorder"}
        memories = []
    return [timers.wrap(model, name, category) for name, category in names.items()] + memories


# Where our generator keeps the encoder output: moved when sentences leave.
ENCODER_MEMORIES = (MemoryPool, ReorderedMemory)


# The parts of our generator's bookkeeping, timed on their own (advance includes the state
# reorder, which is subtracted).
BOOKKEEPING_PARTS = {
    (engine_module, "step_laid_out"): "candidate search",
    (Finalizer, "status"): "stop check",
    (LogProbRules, "apply"): "masking",
    (ModelRunner, "advance"): "history advance",
    (Finalizer, "finish"): "finished hypotheses",
    (Finalizer, "result"): "retiring",
    (Slots, "free"): "retiring",
}


def parts(generator: Any) -> dict[tuple[Any, str], str]:
    """BOOKKEEPING_PARTS and the state reorder (done inside the history advance)."""
    return {**BOOKKEEPING_PARTS, (generator.model, "reorder_states"): "state reorder"}


def bookkeeping_parts(generator: Any, model: torch.nn.Module, batches: list[Batch]) -> str:
    """Shares of a run spent in each part of our generator's bookkeeping."""
    timers = Timers(next(model.parameters()).device)
    restore = [timers.wrap(owner, name, part) for (owner, name), part in parts(generator).items()]
    total = run(generator, model, batches)[0]
    for undo in restore:
        undo()
    seconds = timers.seconds
    seconds["history advance"] = seconds.get("history advance", 0.0) - seconds.pop(
        "state reorder", 0.0
    )
    return ", ".join(f"{part} {100 * t / total:.1f}%" for part, t in seconds.items())


class OperationCounter(TorchDispatchMode):
    """Counts the tensor operations (ATen calls, views included) made outside model forwards,
    by the part of the generator that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "generator loop"
        self.forwards = 0  # > 0 inside a model forward
        self.counts: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()  # of the methods watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if not self.forwards:
            self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))

    def inside(self, owner: Any, name: str, part: str | None) -> Callable[[], None]:
        """Attribute the operations of ``owner.name`` to ``part`` (None: a forward, not counted)."""
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            outer = self.part
            self.part = part or outer
            self.forwards += part is None
            try:
                return original(*args, **kwargs)
            finally:
                self.part = outer
                self.forwards -= part is None

        return replace(owner, name, counted)


def operations_per_step(
    generator: Any, model: torch.nn.Module, batches: list[Batch]
) -> tuple[int, list[tuple[str, float]]]:
    """(decoder steps, tensor operations per step outside the forwards by part): on a small
    batch each operation costs a few microseconds whatever its size, so their number sets the
    floor of the bookkeeping time."""
    counter = OperationCounter()
    watched: dict[tuple[Any, str], str | None] = {**parts(generator)}
    watched |= {(memory, "rearrange"): "encoder reorder" for memory in ENCODER_MEMORIES}
    watched |= {(generator.model, "encode"): None, (generator.model, "decode_step"): None}
    restore = [counter.inside(owner, name, part) for (owner, name), part in watched.items()]
    with counter:
        run(generator, model, batches)
    for undo in restore:
        undo()
    steps = counter.calls["decode_step"]
    return steps, [(part, n / steps) for part, n in counter.counts.most_common()]


def run(generator: Any, model: torch.nn.Module, batches: list[Batch]) -> tuple[float, list]:
    cuda = next(model.parameters()).is_cuda
    start = time.perf_counter()
    outputs = []
    for batch in batches:
        outputs.extend(generator.generate([model], batch))
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def decoder_steps(generator: Any) -> Callable[[], int]:
    """Start counting the decoder steps of ``generator``; the returned function stops and
    tells how many there were."""
    timers = Timers(torch.device("cpu"))
    (restore,) = [
        timers.wrap(generator.model, name, "steps")
        for name in ("decode_step", "forward_decoder")
        if hasattr(generator.model, name)
    ]

    def stop() -> int:
        restore()
        return sum(timers.calls.values())

    return stop


def host_syncs(generator: Any, model: torch.nn.Module, batches: list[Batch]) -> tuple[int, int]:
    """(host synchronisations, decoder steps) of one pass on CUDA, as counted by torch's
    sync debug mode (it warns at every synchronising call: .item(), nonzero, copies to host)."""
    steps = decoder_steps(generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(generator, model, batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return syncs, steps()


def agreement(reference: list, outputs: list) -> tuple[int, int]:
    """(sentences whose hypotheses all agree, sentences)."""
    same = 0
    for ref, out in zip(reference, outputs, strict=True):
        same += len(ref) == len(out) and all(
            r["tokens"].tolist() == o["tokens"].tolist()
            and abs(float(r["score"]) - float(o["score"])) <= 1e-4
            for r, o in zip(ref, out, strict=True)
        )
    return same, len(reference)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    fconv, convs2s, task, source = benchmark_models(args)
    dictionary = task.target_dictionary
    device = torch.device(args.device)
    convs2s, fconv = prepare(convs2s, args.beam).to(device), prepare(fconv, args.beam).to(device)
    options = dict(beam_size=args.beam, max_len_b=args.max_len_b, len_penalty=args.lenpen)
    systems = {
        "fairseq": (FairseqGenerator([fconv], dictionary, **options), fconv),
        "ours/fconv": (SequenceGenerator([fconv], dictionary, **options), fconv),
        "ours/convs2s": (SequenceGenerator([convs2s], dictionary, **options), convs2s),
    }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(
        f"# {source}; beam {args.beam}, {args.threads} threads, {where}, torch {torch.__version__}"
    )
    for batch_size in args.batch_sizes:
        if args.random:
            batches = random_batches(dictionary, args.max_sentences, batch_size, args.seed)
        else:
            batches = checkpoint_batches(task, args.gen_subset, args.max_sentences, batch_size)
        batches = [utils.apply_to_sample(lambda t: t.to(device), b) for b in batches]
        sentences = sum(len(b["id"]) for b in batches)
        times: dict[str, list[float]] = {name: [] for name in systems}
        outputs: dict[str, list] = {}
        for name, (generator, model) in systems.items():  # warm-up, also the outputs
            _, outputs[name] = run(generator, model, batches)
        for _ in range(args.repeats):
            for name, (generator, model) in systems.items():
                times[name].append(run(generator, model, batches)[0])
        tokens = sum(len(hypos[0]["tokens"]) for hypos in outputs["fairseq"])
        print(
            f"\n## batch size {batch_size}: {sentences} sentences, {tokens} output tokens "
            f"(best hypotheses), median of {args.repeats} interleaved runs"
        )
        base = statistics.median(times["fairseq"])
        for name in systems:
            median = statistics.median(times[name])
            same, total = agreement(outputs["fairseq"], outputs[name])
            print(
                f"{name:13s} {median:8.3f} s  {sentences / median:8.1f} sent/s  "
                f"speed-up x{base / median:5.2f}  outputs equal to fairseq: {same}/{total}"
            )
        print("time split (instrumented pass): forward / state+encoder reorder / bookkeeping")
        outside_forwards: dict[str, float] = {}
        for name, (generator, model) in systems.items():
            timers = Timers(device)
            restore = instrument(generator, timers)
            total_time = run(generator, model, batches)[0]
            for undo in restore:
                undo()
            forward = timers.seconds.get("forward", 0.0)
            reorder = timers.seconds.get("reorder", 0.0)
            rest = total_time - forward - reorder
            outside_forwards[name] = total_time - forward
            shares = [100 * part / total_time for part in (forward, reorder, rest)]
            print(
                f"{name:13s} {shares[0]:5.1f}% / {shares[1]:5.1f}% / {shares[2]:5.1f}%   "
                f"(everything but forwards: {shares[1] + shares[2]:.1f}%)"
            )
        print("our bookkeeping by part (instrumented pass, shares of the run)")
        for name, (generator, model) in systems.items():
            if isinstance(generator, SequenceGenerator):
                print(f"{name:13s} {bookkeeping_parts(generator, model, batches)}")
        print(
            "our tensor operations outside the forwards (dispatch count, views included; "
            "time each: everything but forwards / operations)"
        )
        for name, (generator, model) in systems.items():
            if isinstance(generator, SequenceGenerator):
                steps, counts = operations_per_step(generator, model, batches)
                per_step = sum(n for _, n in counts)
                cost = outside_forwards[name] / (per_step * steps)
                listed = ", ".join(f"{part} {n:.1f}" for part, n in counts)
                print(f"{name:13s} {per_step:.1f} per step, {1e6 * cost:.1f} us each: {listed}")
        if device.type == "cuda":
            print("host synchronisations (torch.cuda.set_sync_debug_mode)")
            for name, (generator, model) in systems.items():
                syncs, steps = host_syncs(generator, model, batches)
                per_step = syncs / steps
                print(f"{name:13s} {syncs:7d} in {steps} decoder steps: {per_step:.2f} per step")


if __name__ == "__main__":
    utils.set_torch_seed(1)
    main()

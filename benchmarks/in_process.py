"""fairseq's generator and ours in one process on fconv and convs2s, and where our generator's
time goes: the second part of ``python -m benchmarks.generate`` (its fconv/convs2s models,
``--random`` or a checkpoint's), and the tools ``benchmarks.roofline`` times a decode with.

Three systems, run interleaved (one pass over all batches each, in turn, ``--repeats`` times):

* ``fairseq``: fairseq's fconv + fairseq's SequenceGenerator (the baseline);
* ``ours/fconv``: the same fconv + our SequenceGenerator: (a) the generator alone;
* ``ours/convs2s``: our convs2s (the same weights loaded into it) + our generator:
  (b) end to end.

Each model is prepared as fairseq-generate prepares it (``eval()``, ``prepare_for_inference_``:
weight norm removed, BeamableMM in fconv, no attention kept). Prints the median time per system,
the median speed-up against fairseq, whether the outputs agree (tokens of every hypothesis, scores
within 1e-4), and, from a separate instrumented pass, where the time goes: model forwards
(encoder and decoder steps), reordering of the decoder states / encoder output, and the rest
(search bookkeeping); and how many tensor operations our generator makes per decoder step outside
the forwards, by part (on small batches their number, not their size, sets that time).

With ``--device cuda`` the models and batches live on the GPU, each timed pass ends with a
``torch.cuda.synchronize()``, and a further pass under ``torch.cuda.set_sync_debug_mode`` counts
the host synchronisations per decoder step of each system. The instrumented split synchronises
around each forward on CUDA (else kernel launches, not kernels, would be timed).
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch
from fairseq import utils
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from torch.utils._python_dispatch import TorchDispatchMode

import beamplugin  # noqa: F401  (registers convs2s, safe checkpoint loading)
import beamplugin.engine.engine as engine_module
from beamplugin.engine.ensemble import ReorderedMemory
from beamplugin.engine.finalizer import Finalizer
from beamplugin.engine.model_runner import ModelRunner
from beamplugin.engine.slots import Slots
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.modules import MemoryPool
from beamplugin.search.log_prob_rules import LogProbRules
from benchmarks.common import cpu_description
from benchmarks.models import (
    Batch,
    benchmark_models,
    checkpoint_batches,
    prepare,
    random_batches,
)

# ---------------------------------------------------------------------------------------------
# timing

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


def compare(options: Namespace, threads: int, beam: int) -> list[dict[str, Any]]:
    """The three systems on ``options``' models (``--random``, or ``--path``/``--data``) at
    each batch size, ``threads`` torch threads: the tables printed, and for each system and
    batch size its figures (system, batch, sentences, seconds, tokens, same as fairseq's)."""
    utils.set_torch_seed(1)
    torch.set_num_threads(threads)
    fconv, convs2s, task, source = benchmark_models(options)
    dictionary = task.target_dictionary
    device = torch.device(options.device)
    convs2s, fconv = prepare(convs2s, beam).to(device), prepare(fconv, beam).to(device)
    settings = dict(beam_size=beam, max_len_b=options.max_len_b)
    systems = {
        "fairseq": (FairseqGenerator([fconv], dictionary, **settings), fconv),
        "ours/fconv": (SequenceGenerator([fconv], dictionary, **settings), fconv),
        "ours/convs2s": (SequenceGenerator([convs2s], dictionary, **settings), convs2s),
    }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"\n# in one process: {source}; beam {beam}, {threads} threads, {where}, "
          f"torch {torch.__version__}")  # fmt: skip
    figures = []
    for batch_size in options.batch_sizes:
        count = options.sentences if batch_size > 1 else options.batch_1_sentences
        if options.random:
            batches = random_batches(dictionary, count, batch_size, options.seed)
        else:
            batches = checkpoint_batches(task, options.gen_subset, count, batch_size)
        batches = [utils.apply_to_sample(lambda t: t.to(device), b) for b in batches]
        sentences = sum(len(b["id"]) for b in batches)
        times: dict[str, list[float]] = {name: [] for name in systems}
        outputs: dict[str, list] = {}
        for name, (generator, model) in systems.items():  # warm-up, also the outputs
            _, outputs[name] = run(generator, model, batches)
        for _ in range(options.repeats):
            for name, (generator, model) in systems.items():
                times[name].append(run(generator, model, batches)[0])
        tokens = sum(len(hypos[0]["tokens"]) for hypos in outputs["fairseq"])
        print(
            f"\n## batch size {batch_size}: {sentences} sentences, {tokens} output tokens "
            f"(best hypotheses), median of {options.repeats} interleaved runs"
        )
        base = statistics.median(times["fairseq"])
        for name in systems:
            median = statistics.median(times[name])
            same, total = agreement(outputs["fairseq"], outputs[name])
            print(
                f"{name:13s} {median:8.3f} s  {sentences / median:8.1f} sent/s  "
                f"speed-up x{base / median:5.2f}  outputs equal to fairseq: {same}/{total}"
            )
            best_tokens = sum(len(hypos[0]["tokens"]) for hypos in outputs[name])
            figures.append(dict(system=name, batch=batch_size, sentences=sentences,
                                seconds=median, same=f"{same}/{total}", tokens=best_tokens))
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
    return figures

"""Where a fairseq transformer's decode spends its time with our generator, and what one decoder
step costs against CTranslate2.

1. For each batch size, our generator decodes the test set's first ``--sentences`` (sorted by
   source length, batches as fairseq-generate makes them) and the time splits into the encoder
   forwards, the decoder forwards, and the rest (search, n-best, bookkeeping); the decoder's
   steps in one call of our kernels (beamplugin.kernels.transformer_layers) are replayed alone
   with the same inputs, timed in the same run: what is left of a decoder forward is Python.
2. One sentence decoded with its output length forced to 10 and to 50 tokens (beam 5), by ours
   and by CTranslate2 float32: the difference over 40 steps is a step's cost, the rest the
   sentence's fixed cost.

    python -m benchmarks.transformer_steps --path CHECKPOINT --data DATA_BIN \\
        --batch-sizes 1 64 --threads 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fairseq import checkpoint_utils

import beamplugin  # noqa: F401  (registers the task, safe checkpoint loading)
from beamplugin import SequenceGenerator
from beamplugin.kernels.transformer_layers import DecoderStep
from beamplugin.models import mixed_step_transformer
from benchmarks import common
from benchmarks.common import cpu_description
from benchmarks.generate import ct2_model, test_set_options

BEAM = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="a fairseq transformer checkpoint")
    parser.add_argument("--data", required=True, help="its binarized data directory")
    test_set_options(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    common.add_results_option(parser)
    return parser.parse_args()


class Timed:
    """Wall time spent in ``owner.name`` while installed."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)


class Calls:
    """Records the decoder's steps in one call of our kernels (their inputs) to replay them."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        original = DecoderStep.__call__
        steps = self

        def recorded(step: DecoderStep, *inputs: Any) -> Any:
            if steps.recording:
                copies = (t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
                steps.calls.append((step, tuple(copies)))
            return original(step, *inputs)

        DecoderStep.__call__ = recorded  # type: ignore[method-assign]
        self.original = original

    def replay(self) -> float:
        start = time.perf_counter()
        for step, inputs in self.calls:
            self.original(step, *inputs)
        return time.perf_counter() - start


def batches(items: list[dict], size: int, pad: int) -> list[dict]:
    out = []
    for first in range(0, len(items), size):
        sources = [item["source"] for item in items[first : first + size]]
        width = max(len(s) for s in sources)
        tokens = torch.full((len(sources), width), pad)
        for row, source in enumerate(sources):
            tokens[row, width - len(source) :] = source
        lengths = torch.tensor([len(s) for s in sources])
        out.append({"net_input": {"src_tokens": tokens, "src_lengths": lengths}})
    return out


class Split:
    """Timers on our encoder and decoder forwards and the decoder's steps in one call
    (installed once)."""

    def __init__(self) -> None:
        self.encoder = Timed(mixed_step_transformer.PooledTransformerEncoder, "forward_torchscript")
        self.decoder = Timed(mixed_step_transformer.MixedStepTransformerDecoder, "forward")
        self.products = Calls()


def split(timers: Split, model: Any, dictionary: Any, items: list[dict], size: int,
          repeats: int) -> tuple[str, float]:  # fmt: skip
    """The split of the best of ``repeats`` decodes at batch ``size``, and its sentences/s."""
    generator = SequenceGenerator([model], dictionary, beam_size=BEAM, max_len_b=200)
    work = batches(items, size, dictionary.pad())
    encoder, decoder, products = timers.encoder, timers.decoder, timers.products
    products.calls = []

    def decode() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for sample in work:
                generator.generate([model], sample)
        return time.perf_counter() - start

    decode()
    products.recording = True
    decode()
    products.recording = False
    best: tuple[float, ...] | None = None
    for _ in range(repeats):
        encoder.seconds = decoder.seconds = 0.0
        decoder.calls = 0
        total = decode()
        with torch.inference_mode():
            replayed = products.replay()
        if best is None or total < best[0]:
            best = (total, encoder.seconds, decoder.seconds, decoder.calls, replayed)
    total, encoding, decoding, steps, replayed = best
    return (
        f"batch {size}: {len(items) / total:.1f} sent/s; {total * 1000:.0f} ms = encoder "
        f"{encoding * 1000:.0f} + decoder {decoding * 1000:.0f} ({steps} steps, "
        f"{decoding / steps * 1000:.2f} ms each; its C calls alone {replayed * 1000:.0f}) "
        f"+ search and the rest {(total - encoding - decoding) * 1000:.0f}"
    ), len(items) / total


def step_costs(args: argparse.Namespace, model: Any, dictionary: Any,
               item: dict) -> dict[str, float]:
    """Ours and CTranslate2's milliseconds a decoder step on ``item``, each line printed."""
    import ctranslate2

    sample = {"net_input": {"src_tokens": item["source"].view(1, -1),
                            "src_lengths": torch.tensor([len(item["source"])])}}  # fmt: skip
    eos = dictionary.eos()
    words = [[dictionary[t] for t in item["source"].tolist() if t != eos]]
    with tempfile.TemporaryDirectory() as workdir:
        translator = ctranslate2.Translator(
            str(ct2_model(args.path, args.data, None, Path(workdir))), device="cpu",
            compute_type="float32", intra_threads=args.threads, inter_threads=1,
        )  # fmt: skip

    generators = {
        length: SequenceGenerator([model], dictionary, beam_size=BEAM, min_len=length,
                                  max_len_a=0, max_len_b=length)
        for length in (10, 50)
    }  # fmt: skip

    def ours(length: int) -> None:
        with torch.inference_mode():
            generators[length].generate([model], sample)

    def ct2(length: int) -> None:
        translator.translate_batch(words, beam_size=BEAM, max_decoding_length=length,
                                   min_decoding_length=length)  # fmt: skip

    costs = {}
    for name, decode in (("ours", ours), ("ct2 float32", ct2)):
        short, long = (min(_seconds(decode, n) for _ in range(7)) for n in (10, 50))
        step = (long - short) / 40
        print(f"{name:12s} {step * 1000:.3f} ms a step (beam {BEAM}), "
              f"{(short - 10 * step) * 1000:.2f} ms a sentence besides")  # fmt: skip
        costs[name] = step * 1000
    return costs


def _seconds(decode: Callable[[int], None], length: int) -> float:
    start = time.perf_counter()
    decode(length)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data}
    )
    model = models[0].eval()
    dictionary = task.target_dictionary
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    items = [dataset[i] for i in range(min(args.sentences, len(dataset)))]
    items.sort(key=lambda item: len(item["source"]))
    print(f"# {args.path}; beam {BEAM}; {args.threads} thread(s); {cpu_description()}")
    costs = step_costs(args, model, dictionary, items[len(items) // 2])
    where = dict(command=common.command_line(), **common.machine(threads=args.threads))
    records = [common.record(
        table=common.table_name(), row="steps-b1", system=name, model=args.path,
        what=f"{args.path}: one sentence's decoder step (beam {BEAM})", precision="float32",
        batch=1, ms_per_step=ms, **where) for name, ms in costs.items()]  # fmt: skip
    timers = Split()
    for size in args.batch_sizes:
        text, rate = split(timers, model, dictionary, items, size, args.repeats)
        print(text)
        records.append(common.record(
            table=common.table_name(), row=f"steps-split-b{size}", system="ours",
            model=args.path, what=f"{args.path}: our decode split into its parts",
            precision="float32", batch=size, sentences_per_s=rate, **where))  # fmt: skip
    common.append_records(args.results, records)


if __name__ == "__main__":
    main()

"""The precision models decode in: float32, bfloat16, float16, or float32 with int8 products.

The models compute in the chosen precision: their parameters are cast once, and the weights
they derive for inference (folded weight norm, linearized convolutions, packed layouts, see
beamplugin.modules.inference_cache.InferenceCache) are then made once from those, in that precision.
The search itself stays in float32 whatever the models compute in: every step's logits are
widened to float32 before the temperature and the log-softmax (beamplugin.engine.ensemble), so
cumulative scores, length normalisation and the stop tests are float32.

Where a precision has no hardware support (checked per device), float16 is refused with a clear
message. ``--bf16`` on a CPU with AVX512-BF16 keeps the models in float32 and packs their
products' weights in bfloat16 for our kernel (beamplugin.kernels.float_products.Bf16Weights):
each product rounds its rows to bfloat16 and sums in float32, everything else (norms,
attention, the residual stream) stays float32, so the float32 paths run as they are (a
transformer's step in one call). Elsewhere the models are cast to bfloat16 (torch's products).
``--bf16`` on the CPU is never slower than float32: where the CPU has no bfloat16
arithmetic, or where a load-time trial (:func:`bf16_pays`) decodes the models slower in bfloat16
than in float32, they decode in float32 and the log says so. ``int8``
(CPU only) keeps float32 and multiplies the largest weights in int8 instead, each row of
activations with its own scale, so that a sentence's result does not depend on its batch-mates
(beamplugin.modules.int8_weights.int8_linear).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterable

import torch
from fairseq.models.transformer import TransformerModelBase
from torch import nn

from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.kernels import float_products, trials
from beamplugin.kernels.trials import Trial
from beamplugin.modules import int8_weights
from beamplugin.modules.inference_cache import InferenceCache
from beamplugin.modules.packed_weights import native_on_cpu

logger = logging.getLogger(__name__)

# Each precision and the dtype the models compute in: "int8" keeps float32 but multiplies the
# largest weights in int8 (beamplugin.modules.int8_weights.int8_linear), on the CPU only.
PRECISIONS = {
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.float32,
}
# bf16_pays's trial: sentences a call decodes (a step of 5 rows at beam 5, one of 80), each of
# this many source tokens and decoded to exactly this many target tokens (no early stop in
# either precision: both do the same work).
BF16_TRIAL_SENTENCES = (1, 16)
BF16_TRIAL_LENGTH = 8
BF16_TRIAL = "bf16_decode"  # the trial's name in beamplugin.kernels.trials


def requested_precision(fp16: bool, bf16: bool, int8: bool = False) -> str:
    """The precision fairseq's ``--fp16`` / ``--bf16`` (or our task's ``--int8``) ask for."""
    flags = {"fp16": fp16, "bf16": bf16, "int8": int8}
    chosen = [name for name, on in flags.items() if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join('--' + c for c in chosen)} exclude each other: pass one")
    return chosen[0] if chosen else "float32"


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision that should not decode on ``device``."""
    dtype = PRECISIONS[precision]
    if precision == "int8":
        if device.type != "cpu":
            raise ValueError(
                f"--int8 on {device}: int8 products run on the CPU only (torch._int_mm with "
                "per-row scales); on a GPU decode with --fp16 or --bf16"
            )
        return
    if dtype == torch.float32:
        return
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"--bf16: the GPU {name} has no bfloat16; use --fp16")
        return
    if device.type != "cpu" or native_on_cpu(dtype) or dtype == torch.bfloat16:
        return  # bfloat16 without hardware products decodes in float32 (bf16_pays)
    raise ValueError(
        "--fp16 on this CPU: it has no float16 arithmetic (no AVX512-FP16 or AVX-NE-CONVERT), "
        "so float16 products are emulated and decode slower than float32 (see the README, "
        "Reduced precision). Decode with --bf16 for reduced precision, or leave out --fp16 "
        "for float32."
    )


def bf16_pays(models: list[nn.Module]) -> bool:
    """Whether ``models`` (float32, on the CPU) decode faster in bfloat16 than in float32 here:
    not where the CPU has no bfloat16 products (torch emulates them), else the verdict of a
    trial that decodes a few random sentences both ways through our generator (all of it: our
    float32 runs kernels bfloat16 may not, such as the transformer's step in one call). Timed
    once per CPU, code version and models' shapes, kept and pinned as our kernels' trials
    (beamplugin.kernels.trials: a pinned ``BEAMPLUGIN_ISA`` keeps bfloat16). Logged once where
    the answer is no."""
    if not native_on_cpu(torch.bfloat16):
        logger.warning(
            "--bf16 on this CPU: it has no bfloat16 products (no AVX512-BF16 or AMX), so torch "
            "would emulate them, slower than float32: decoding in float32"
        )
        return False
    translators = [m for m in models if getattr(m, "encoder", None) is not None]
    if not translators:
        return True  # nothing our generator decodes alone: as asked
    shapes = hashlib.sha256()
    for model in translators:
        shapes.update(type(model).__name__.encode())
        for name, parameter in model.named_parameters():
            shapes.update(f"{name}{tuple(parameter.shape)}".encode())
    form = "weights" if float_products.bf16_weights_available() else "cast"
    shape = (type(translators[0]).__name__, shapes.hexdigest()[:12], form)
    sides = "float32, bfloat16"
    if trials.ours_is_faster(BF16_TRIAL, shape, lambda: _bf16_trial(translators), sides):
        return True
    logger.warning(
        "--bf16: these models decode slower in bfloat16 than in float32 on this CPU (trial %s "
        "%s): decoding in float32",
        BF16_TRIAL,
        shape,
    )
    return False


def _bf16_trial(models: list[nn.Module]) -> Trial:
    """Our generator on a bfloat16 copy of ``models`` (bfloat16 weights where our kernel runs,
    else the models cast) against it on ``models`` (float32): beam 5, random sources, every
    hypothesis decoded to the same length."""
    first = models[0]
    source, target = first.encoder.dictionary, first.decoder.dictionary
    length = BF16_TRIAL_LENGTH
    options = dict(beam_size=5, max_len_b=length, min_len=length, attention=False)
    if float_products.bf16_weights_available():
        half = [copy.deepcopy(m) for m in models]
        _switch_products(half, int8=False, bf16=True)
    else:
        half = [copy.deepcopy(m).to(torch.bfloat16) for m in models]
    in_bf16 = SequenceGenerator(half, target, **options)
    in_float32 = SequenceGenerator(models, target, **options)
    g = torch.Generator().manual_seed(0)
    samples = []
    for sentences in BF16_TRIAL_SENTENCES:
        words = torch.randint(source.nspecial, len(source), (sentences, BF16_TRIAL_LENGTH),
                              generator=g)  # fmt: skip
        tokens = torch.cat([words, torch.full((sentences, 1), source.eos())], 1)
        lengths = torch.full((sentences,), BF16_TRIAL_LENGTH + 1)
        net_input = {"src_tokens": tokens, "src_lengths": lengths}
        samples.append(({"id": torch.arange(sentences), "net_input": net_input},))
    return Trial(
        lambda sample: in_bf16.generate(None, sample),
        lambda sample: in_float32.generate(None, sample),
        samples,
    )


def _switch_products(models: list[nn.Module], int8: bool, bf16: bool) -> None:
    """Int8 or bfloat16-weight products on or off in ``models``' products: their modules'
    with inference weights, and fairseq transformers' decoders (whose prepared weights
    beamplugin.models.transformer_weights makes again when these change)."""
    for model in models:
        modules = [m for m in model.modules() if isinstance(m, InferenceCache)]
        if isinstance(model, TransformerModelBase):
            modules.append(model.decoder)
        for module in modules:
            module.int8_products, module.bf16_products = int8, bf16


def cast_for_decoding(models: Iterable[nn.Module | None], precision: str) -> torch.dtype:
    """Check ``precision`` (a key of PRECISIONS) on the models' devices and cast ``models``
    (None entries skipped) to it in place; returns the dtype the models' activations compute
    in: float32 for ``bf16`` on a CPU where our bfloat16 kernel multiplies float32 rows on
    bfloat16 weights, or where :func:`bf16_pays` says no. The cast drops the models' cached
    inference weights, which are then made again in that precision on first use."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    models = [m for m in models if m is not None]
    devices = {p.device for model in models for p in model.parameters()}
    for device in sorted(devices, key=str):
        check_precision(precision, device)
    caches = [m for model in models for m in model.modules() if isinstance(m, InferenceCache)]
    # fairseq transformers' decoders: their steps run on prepared weights
    # (beamplugin.models.transformer_weights), made in int8 where this flag is set
    transformer_decoders = [m.decoder for m in models if isinstance(m, TransformerModelBase)]
    if precision == "int8":
        large = sum(
            any(int8_weights.large_for_int8(p) for p in m.parameters()) for m in caches
        ) + sum(
            int8_weights.large_for_int8(p)
            for decoder in transformer_decoders
            for p in decoder.parameters()
        )
        if not large:
            raise ValueError(
                "--int8: these models have no weight for int8 products (beamplugin's convs2s "
                "and fairseq's transformer decoder multiply weights of "
                f"{int8_weights.INT8_MIN_WEIGHTS} elements or more in int8); they would "
                "decode in float32: leave out --int8"
            )
        levels = int8_weights.int8_weight_levels()
        logger.info(
            "--int8: %d weights multiplied in int8, %s",
            large,
            "8-bit weights (summed exactly: our int8 kernel, or torch's with VNNI or AMX)"
            if levels == 127
            else "7-bit weights (torch's int8 products, which sum pairs in 16 bits here)",
        )
    bf16_weights = False
    if dtype == torch.bfloat16 and devices == {torch.device("cpu")}:
        for model in models:
            model.to(torch.float32)  # the trial's float32 side, and the fallback's models
        if not bf16_pays(models):
            dtype = torch.float32
        elif float_products.bf16_weights_available():
            dtype, bf16_weights = torch.float32, True
            logger.info("--bf16: float32 activations, products on bfloat16 weights (our kernel)")
    for model in models:
        model.to(dtype)
    _switch_products(models, precision == "int8", bf16_weights)
    return dtype

"""The precision models decode in: float32, bfloat16, float16, or float32 with int8 products.

The models compute in the chosen precision: their parameters are cast once, and the weights
they derive for inference (folded weight norm, linearized convolutions, packed layouts, see
beamplugin.modules.linear.InferenceCache) are then made once from those, in that precision.
The search itself stays in float32 whatever the models compute in: every step's logits are
widened to float32 before the temperature and the log-softmax (beamplugin.engine.ensemble), so
cumulative scores, length normalisation and the stop tests are float32.

Where a precision has no hardware support (checked per device), float16 is refused with a clear
message and bfloat16 decodes as asked with a warning: never a silent float32 run. ``int8``
(CPU only) keeps float32 and multiplies the largest weights in int8 instead, each row of
activations with its own scale, so that a sentence's result does not depend on its batch-mates
(beamplugin.modules.linear.int8_linear).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from fairseq.models.transformer import TransformerModelBase
from torch import nn

from beamplugin.modules import linear as linear_module
from beamplugin.modules.linear import InferenceCache, native_on_cpu

logger = logging.getLogger(__name__)

# Each precision and the dtype the models compute in: "int8" keeps float32 but multiplies the
# largest weights in int8 (beamplugin.modules.linear.int8_linear), on the CPU only.
PRECISIONS = {
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.float32,
}


def requested_precision(fp16: bool, bf16: bool, int8: bool = False) -> str:
    """The precision fairseq's ``--fp16`` / ``--bf16`` (or our task's ``--int8``) ask for."""
    flags = {"fp16": fp16, "bf16": bf16, "int8": int8}
    chosen = [name for name, on in flags.items() if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join('--' + c for c in chosen)} exclude each other: pass one")
    return chosen[0] if chosen else "float32"


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision that should not decode on ``device``; warn where it is slow."""
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
    if device.type != "cpu" or native_on_cpu(dtype):
        return
    if dtype == torch.float16:
        raise ValueError(
            "--fp16 on this CPU: it has no float16 arithmetic (no AVX512-FP16 or AVX-NE-CONVERT), "
            "so float16 products are emulated and decode slower than float32 (see the README, "
            "Reduced precision). Decode with --bf16 for reduced precision, or leave out --fp16 "
            "for float32."
        )
    logger.warning(
        "--bf16 on this CPU: it has no bfloat16 products (no AVX512-BF16 or AMX), so torch "
        "emulates them; decoding in bfloat16 as asked, but slower than float32 here (see the "
        "README, Reduced precision)"
    )


def cast_for_decoding(models: Iterable[nn.Module | None], precision: str) -> torch.dtype:
    """Check ``precision`` (a key of PRECISIONS) on the models' devices and cast ``models``
    (None entries skipped) to it in place; returns the dtype. The cast drops the models' cached
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
            max(p.numel() for p in m.parameters()) >= linear_module.INT8_MIN_WEIGHTS
            for m in caches
        ) + sum(
            p.numel() >= linear_module.INT8_MIN_WEIGHTS
            for decoder in transformer_decoders
            for p in decoder.parameters()
        )
        if not large:
            raise ValueError(
                "--int8: these models have no weight for int8 products (beamplugin's convs2s "
                "and fairseq's transformer decoder multiply weights of "
                f"{linear_module.INT8_MIN_WEIGHTS} elements or more in int8); they would "
                "decode in float32: leave out --int8"
            )
        levels = linear_module.int8_weight_levels()
        logger.info(
            "--int8: %d weights multiplied in int8, %s",
            large,
            "8-bit weights (summed exactly: our int8 kernel, or torch's with VNNI or AMX)"
            if levels == 127
            else "7-bit weights (torch's int8 products, which sum pairs in 16 bits here)",
        )
    for model in models:
        model.to(dtype)
    for module in caches + transformer_decoders:
        module.int8_products = precision == "int8"
    return dtype

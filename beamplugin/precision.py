"""The floating-point precision models decode in: float32, bfloat16 or float16.

The models compute in the chosen precision: their parameters are cast once, and the weights
they derive for inference (folded weight norm, linearized convolutions, oneDNN's packed layout,
see beamplugin.modules.linear.InferenceCache) are then made once from those, in that precision.
The search itself stays in float32 whatever the models compute in: every step's logits are
widened to float32 before the temperature and the log-softmax (beamplugin.ensemble), so
cumulative scores, length normalisation and the stop tests are float32.

Where a precision has no hardware support (checked per device), float16 is refused with a clear
message and bfloat16 decodes as asked with a warning: never a silent float32 run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

PRECISIONS = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def requested_precision(fp16: bool, bf16: bool) -> str:
    """The precision fairseq's ``--fp16`` / ``--bf16`` ask for."""
    if fp16 and bf16:
        raise ValueError("--fp16 and --bf16 exclude each other: pass one of them")
    return "fp16" if fp16 else "bf16" if bf16 else "float32"


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices in hardware (oneDNN's own test: AVX512-BF16
    or AMX for bfloat16, AVX512-FP16 or AVX-NE-CONVERT for float16); without it torch converts
    every element and its half-precision products are slower than float32."""
    if dtype == torch.float32:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def check_precision(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a precision that should not decode on ``device``; warn where it is slow."""
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
        check_precision(dtype, device)
    for model in models:
        model.to(dtype)
    return dtype

"""Which kernel multiplies float32 rows on bfloat16 weights (``--bf16``,
beamplugin.kernels.float_products.Bf16Weights): AVX512-BF16's ``vdpbf16ps``
(``native/bf16_products.c``) or, on a CPU with AMX, its tiles (``native/bf16_amx.c``), both
on the same panels with the same contract (rows rounded to bfloat16 once, float32 sums, a row's
bits independent of its batch).

AMX is taken only once proven, once a process: its products of a small weight with every tail
(rows, channels and odd inner positions) within float32's rounding of float32's product of the
same bfloat16 values, a row alone the same bits as in its batch, and faster than AVX512-BF16's
(beamplugin.kernels.trials, kept on disk; ``BEAMPLUGIN_ISA=amx`` pins it, ``avx512`` rules it
out). Otherwise AVX512-BF16's kernel is used, the log saying why.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from beamplugin.kernels import instruction_sets, layouts, native_library, trials
from beamplugin.kernels.native_library import INT, POINTER, SIZE
from beamplugin.kernels.trials import Trial

logger = logging.getLogger(__name__)

# x, its row stride, the panels, bias, residual, its row stride, y, its row stride, rows, out,
# in, relu, threads; returns -1 where it could not allocate x's bfloat16 rows
SIGNATURE = [POINTER, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, INT,
             INT]  # fmt: skip
AVX512_BF16, AMX = "avx512_bf16", "amx"
_SOURCES = {  # each kernel's file, its check that this build and CPU run it, its symbol
    AVX512_BF16: ("bf16_products", "bf16_kernel_available", "bf16_weight_products"),
    AMX: ("bf16_amx", "amx_kernel_available", "bf16_amx_weight_products"),
}
# the proof's product: rows, channels and inner positions past whole tiles and panels
PROOF_SHAPE = (49, 77, 45)  # rows (a block of 32, one of 17), out, in
# the speed trial's weight (a transformer's 512 x 512 projection) at a step's rows and a batch's
TRIAL_SHAPE = (512, 512)
TRIAL = "bf16_amx"


def named(name: str) -> Callable[..., Any] | None:
    """The kernel ``name`` (:data:`AVX512_BF16` or :data:`AMX`) where this build and CPU run it
    (AMX: where Linux grants the process its tile data), else None."""
    source, available, symbol = _SOURCES[name]
    if name == AMX and not instruction_sets.amx_allowed():
        return None
    return native_library.function_for_this_cpu(source, available, symbol, SIGNATURE, INT)


@native_library.cached
def chosen() -> tuple[str, Callable[..., Any]] | None:
    """The kernel this process multiplies float32 rows on bfloat16 weights with, and its name:
    AMX's where proven (:func:`amx_proven`), else AVX512-BF16's; None where neither runs."""
    avx512 = named(AVX512_BF16)
    amx = named(AMX)
    if amx is not None and (avx512 is None or amx_proven(amx, avx512)):
        logger.info("--bf16 products on AMX tiles")
        return AMX, amx
    return None if avx512 is None else (AVX512_BF16, avx512)


def address() -> int | None:
    """Where :func:`chosen`'s kernel is, for C code that calls it (None where none runs)."""
    kernel = chosen()
    return None if kernel is None else ctypes.cast(kernel[1], ctypes.c_void_p).value


def call(kernel: Callable[..., Any], x: Tensor, panels: Tensor, bias: Tensor | None,
         residual: Tensor | None, out: int, relu: bool, threads: int) -> Tensor:  # fmt: skip
    """``kernel``'s product of float32 ``x`` ``[rows, in]`` (contiguous rows) on ``panels``
    (``[ceil(out / 32), ceil(in / 2), 32, 2]`` bfloat16), operands checked by the caller."""
    rows, inner = x.shape
    y = x.new_empty((rows, out))
    failed = kernel(
        x.data_ptr(), x.stride(0), panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        y.data_ptr(), out, rows, out, inner, int(relu), threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory to round {rows} rows to bfloat16")
    return y


def amx_proven(amx: Callable[..., Any], avx512: Callable[..., Any] | None) -> bool:
    """Whether AMX's kernel gives float32's products (of the same bfloat16 values, within float32
    sums' rounding) with every tail, a row's bits whatever its batch, and (against
    AVX512-BF16's, where it runs) pays: logged where not."""
    g = torch.Generator().manual_seed(0)
    rows, out, inner = PROOF_SHAPE
    weight = torch.randn(out, inner, generator=g).bfloat16()
    x, bias = torch.randn(rows, inner, generator=g), torch.randn(out, generator=g)
    residual = torch.randn(rows, out, generator=g)
    panels = layouts.panels(weight, 2)
    y = call(amx, x, panels, bias, residual, out, True, 1)
    float32 = F.linear(x.bfloat16().float(), weight.float(), bias).relu() + residual
    # float32 sums in another order: within a few roundings of the sum of the terms' sizes
    scale = F.linear(x.bfloat16().float().abs(), weight.float().abs()) + bias.abs()
    wrong = ((y - float32).abs() > 1e-5 * (scale + residual.abs()) + 1e-30).sum().item()
    alone = all(
        torch.equal(call(amx, x[r : r + 1], panels, bias, residual[r : r + 1], out, True, 1),
                    y[r : r + 1])
        for r in (0, 17, rows - 1)
    )  # fmt: skip
    if wrong or not alone:
        logger.warning(
            "--bf16: AMX's products failed their proof (%d of %d outputs off float32's, a row "
            "alone %s its batch's bits): AVX512-BF16's kernel instead",
            wrong, y.numel(), "the same as" if alone else "not",
        )  # fmt: skip
        return False
    if avx512 is None:
        return True
    sides = "AVX512-BF16's bf16 products, AMX's"
    return trials.ours_is_faster(TRIAL, TRIAL_SHAPE, lambda: trial(amx, avx512), sides)


def trial(amx: Callable[..., Any], avx512: Callable[..., Any]) -> Trial:
    """AMX's products against AVX512-BF16's on :data:`TRIAL_SHAPE`, at 5 rows and at 80."""
    out, inner = TRIAL_SHAPE
    panels = layouts.panels(torch.randn(out, inner).bfloat16(), 2)
    bias = torch.randn(out)

    def run(kernel: Callable[..., Any]) -> Callable[[Tensor], Tensor]:
        return lambda x: call(kernel, x, panels, bias, None, out, False, 1)

    return Trial(run(amx), run(avx512), [(torch.randn(rows, inner),) for rows in (5, 80)])

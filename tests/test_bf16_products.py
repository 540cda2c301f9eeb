"""Our bfloat16 kernels (beamplugin/kernels/native/bf16_products.c on AVX512-BF16 CPUs,
bf16_amx.c's on AMX's tiles): products within bfloat16's rounding of float64's, a row's bits
independent of its batch and the threads, relu as the unfused operation gives it, the residual
added before the one rounding (bfloat16 results) or after the float32 sums (float32 rows on
bfloat16 weights); AMX's built only for a CPU with it, proven, and ruled out by
BEAMPLUGIN_ISA=avx512."""

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from beamplugin.kernels import (
    bf16_kernels,
    float_products,
    instruction_sets,
    layouts,
    native_library,
)
from beamplugin.kernels.instruction_sets import AMX_FLAGS, AVX512
from beamplugin.modules import packed_weights

CC = os.environ.get("CC", "cc")

needs_kernel = pytest.mark.skipif(
    not float_products.available(torch.bfloat16), reason="no AVX512-BF16 or no C compiler here"
)
SHAPES = [(1032, 256), (256, 256), (256, 1024), (37, 101), (1, 3)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_products_round_once_to_bfloat16(shape):
    torch.manual_seed(0)
    weight, bias = (torch.randn(shape) * 0.1).bfloat16(), torch.randn(shape[0]).bfloat16()
    packed = packed_weights.pack_weight(weight)
    assert isinstance(packed, float_products.Panels)
    x, residual = torch.randn(37, shape[1]).bfloat16(), torch.randn(37, shape[0]).bfloat16()
    out = float_products.product(x, packed, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == (37, shape[0])
    # within one bfloat16 rounding (8 bits) of the float64 product, float32 sums aside
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-3)
    summed = float_products.product(x, packed, bias, residual=residual)
    torch.testing.assert_close(summed.double(), exact + residual.double(), rtol=2**-8, atol=1e-3)
    assert torch.equal(float_products.product(x, packed, bias, relu=True), out.relu())


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads():
    torch.manual_seed(1)
    weight, bias = (torch.randn(1032, 256) * 0.1).bfloat16(), torch.randn(1032).bfloat16()
    packed = float_products.pack(weight)
    x = torch.randn(320, 256).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = float_products.product(x, packed, bias)
        torch.set_num_threads(2)
        assert torch.equal(float_products.product(x, packed, bias), everything)
        for rows in (1, 2, 7, 8, 9, 40):
            assert torch.equal(float_products.product(x[:rows], packed, bias), everything[:rows])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="bfloat16"):
        float_products.product(x.float(), packed, bias)
    with pytest.raises(ValueError, match="256"):
        float_products.product(torch.randn(2, 255).bfloat16(), packed, bias)


# --bf16: float32 rows on bfloat16 weights (float_products.Bf16Weights), on each kernel this CPU
# runs (beamplugin.kernels.bf16_kernels): AVX512-BF16's vdpbf16ps, AMX's tiles
@pytest.fixture(params=[bf16_kernels.AVX512_BF16, bf16_kernels.AMX])
def weight_kernel(request, monkeypatch):
    """The kernel the param names as the one float_products.product calls (a skip where this
    CPU or build does not run it)."""
    kernel = bf16_kernels.named(request.param)
    if kernel is None:
        pytest.skip(f"no {request.param} bfloat16 kernel here (CPU, compiler or Linux's grant)")
    monkeypatch.setattr(bf16_kernels, "chosen", lambda: (request.param, kernel))
    return request.param


def vdpbf16ps_definition(x, weight, bias):
    """x @ weight.T + bias as vdpbf16ps defines it, in float32: x and weight rounded to bfloat16
    (to nearest even), each pair of products (exact in float32) added to the sum one at a time,
    the odd position's first, one rounding each; the bias added last."""
    xb, wb = x.bfloat16().float(), weight.bfloat16().float()
    acc = torch.zeros(x.size(0), weight.size(0))
    for pair in range(0, x.size(1), 2):
        for k in (pair + 1, pair):
            if k < x.size(1):
                acc = acc + xb[:, k : k + 1] * wb[:, k]
    return acc + bias


# tails: rows past whole tiles (16) and blocks, channels past whole panels (32) and half panels
# (16), odd inner positions and pairs past whole AMX tiles (16 pairs)
SHAPES_BF16_WEIGHTS = [(1032, 256), (256, 1024), (37, 101), (1, 3), (17, 33), (48, 45)]


@pytest.mark.parametrize("shape", SHAPES_BF16_WEIGHTS, ids=str)
@pytest.mark.parametrize("rows", [13, 37])
def test_float32_rows_on_bfloat16_weights_round_once_and_sum_in_float32(
    weight_kernel, shape, rows
):
    torch.manual_seed(2)
    weight, bias = torch.randn(shape) * 0.1, torch.randn(shape[0])
    packed = float_products.pack_bf16_weights(weight)
    x, residual = torch.randn(rows, shape[1]), torch.randn(rows, shape[0])
    out = float_products.product(x, packed, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    if weight_kernel == bf16_kernels.AVX512_BF16:
        assert torch.equal(out, vdpbf16ps_definition(x, weight, bias))
    # float32 sums of the bfloat16 values' products, in some fixed order: within float32's
    # rounding of float64's sum of the same values, and within bfloat16's of the unrounded
    xb, wb = x.bfloat16().double(), weight.bfloat16().double()
    summed = F.linear(xb, wb, bias.double())
    scale = F.linear(xb.abs(), wb.abs()) + bias.double().abs()
    assert ((out.double() - summed).abs() <= 2**-16 * scale).all()
    exact = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=2**-7 * scale.max().item())
    assert torch.equal(float_products.product(x, packed, bias, relu=True), out.relu())
    assert torch.equal(float_products.product(x, packed, bias, residual=residual), out + residual)
    both = float_products.product(x, packed, bias, residual=residual, relu=True)
    assert torch.equal(both, out.relu() + residual)
    assert torch.equal(float_products.product(x, packed, None) + bias, out)
    channels = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
    picked = float_products.columns(packed, channels)
    assert isinstance(picked, float_products.Bf16Weights)
    assert torch.equal(float_products.product(x, picked, bias[channels]), out[:, channels])


def test_a_float32_rows_bits_on_bfloat16_weights_do_not_depend_on_its_batch_or_the_threads(
    weight_kernel,
):
    torch.manual_seed(3)
    weight, bias = torch.randn(1032, 255) * 0.1, torch.randn(1032)
    packed = float_products.pack_bf16_weights(weight)
    x = torch.randn(321, 255)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = float_products.product(x, packed, bias)
        torch.set_num_threads(2)
        assert torch.equal(float_products.product(x, packed, bias), everything)
        for rows in (1, 5, 11, 12, 13, 15, 16, 17, 31, 32, 33, 59, 60, 61, 200):
            assert torch.equal(float_products.product(x[:rows], packed, bias), everything[:rows])
        assert torch.equal(float_products.product(x[7:70], packed, bias), everything[7:70])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="float32"):
        float_products.product(x.bfloat16(), packed, bias)
    with pytest.raises(ValueError, match="255"):
        float_products.product(torch.randn(2, 256), packed, bias)


def test_amx_is_proven_where_the_cpu_has_it_and_pinned_off_by_avx512(kernels_for):
    amx = bf16_kernels.named(bf16_kernels.AMX)
    if amx is None:
        pytest.skip("no AMX bfloat16 kernel here (CPU, compiler or Linux's grant)")
    assert bf16_kernels.amx_proven(amx, None)
    kernels_for("amx")  # pinned: proven, not timed
    assert bf16_kernels.chosen()[0] == bf16_kernels.AMX
    kernels_for("avx512")
    assert bf16_kernels.named(bf16_kernels.AMX) is None
    assert bf16_kernels.chosen()[0] == bf16_kernels.AVX512_BF16


def test_the_amx_kernel_is_built_only_for_a_cpu_with_amx(tmp_path):
    """AMX's flags go to its source alone, for AVX-512 on a CPU with amx_bf16; built with them
    (where the compiler takes them), a CPU without AMX is told it has no kernel."""
    v4 = instruction_sets.AVX512.requires | {"avx512_bf16", "avx512_vnni"}
    sapphire_rapids = v4 | instruction_sets.AMX_FEATURES
    assert instruction_sets.source_flags(AVX512, "bf16_amx", sapphire_rapids) == AMX_FLAGS
    assert instruction_sets.source_flags(AVX512, "bf16_amx", v4) == ()
    assert instruction_sets.source_flags(AVX512, "bf16_products", sapphire_rapids) == ()
    assert instruction_sets.source_flags(instruction_sets.AVX2, "bf16_amx", sapphire_rapids) == ()
    if shutil.which(CC) is None or platform.machine() not in AVX512.machines:
        pytest.skip("no C compiler or not x86-64")
    library = tmp_path / "bf16_amx.so"
    flags = [*native_library.FLAGS, *instruction_sets.build_flags(AVX512, sapphire_rapids)]
    source = str(native_library.SOURCES / "bf16_amx.c")
    built = subprocess.run([CC, *flags, *AMX_FLAGS, "-o", str(library), source],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"{CC} does not build AMX code: {built.stderr[-200:]}")
    assert built.stderr == ""
    loaded = ctypes.CDLL(str(library))
    assert hasattr(loaded, "bf16_amx_weight_products")
    has_amx = instruction_sets.AMX_FEATURES <= instruction_sets.cpu_features()
    if not has_amx:
        assert loaded.amx_kernel_available() == 0


def test_a_compiler_without_amx_builds_the_file_without_it(tmp_path, monkeypatch, kernels_for):
    """Where the CPU has AMX but the compiler refuses its flags, AMX's file is built without
    them (no AMX kernel, every other kernel as before)."""
    compiler = shutil.which(CC)
    if compiler is None or not instruction_sets.runs_here(AVX512):
        pytest.skip("no C compiler or no AVX-512 here")
    refusing = tmp_path / "cc"
    refusing.write_text(
        f'#!/bin/sh\ncase "$*" in *-mamx-tile*) exit 1;; esac\nexec {compiler} "$@"\n'
    )
    refusing.chmod(0o755)
    monkeypatch.setenv("CC", str(refusing))
    monkeypatch.setenv(native_library.CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(instruction_sets, "source_flags",
                        lambda isa, source, features=None: AMX_FLAGS if source == "bf16_amx"
                        else ())  # fmt: skip
    kernels_for("")
    library = native_library.load("bf16_amx")
    assert library is not None and library.amx_kernel_available() == 0
    assert not hasattr(library, "bf16_amx_weight_products")
    assert native_library.load("bf16_products") is not None


def test_the_amx_kernels_tiles_emulated_give_a_rows_bits_whatever_its_batch(tmp_path):
    """bf16_amx.c with its tile instructions done in C (tests/amx_emulation.c), on any CPU with
    AVX512-BF16: its proof passes, every tail within float32's rounding of the sums, a row alone
    the same bits as in its batch, whatever the threads."""
    avx512 = bf16_kernels.named(bf16_kernels.AVX512_BF16)
    if avx512 is None or shutil.which(CC) is None:
        pytest.skip("no AVX512-BF16 kernel or no C compiler here")
    if bf16_kernels.named(bf16_kernels.AMX) is not None:
        # (and gcc 13's headers, with AMX's real flags available, keep the emulated build's kernel
        # out: seen on a Sapphire Rapids host)
        pytest.skip("the real AMX kernel runs here: the tests above run it on the tiles")
    library = tmp_path / "amx_emulation.so"
    flags = [*native_library.FLAGS, *instruction_sets.build_flags(AVX512)]
    source = str(Path(__file__).with_name("amx_emulation.c"))
    built = subprocess.run([CC, *flags, "-D__AMX_TILE__", "-D__AMX_BF16__", "-o", str(library),
                            source], capture_output=True, text=True)  # fmt: skip
    if built.returncode != 0:  # a compiler whose AMX intrinsics cannot be replaced so
        pytest.skip(f"{CC} does not build the emulation: {built.stderr[-300:]}")
    amx = ctypes.CDLL(str(library)).bf16_amx_weight_products
    amx.argtypes, amx.restype = bf16_kernels.SIGNATURE, ctypes.c_int
    assert bf16_kernels.amx_proven(amx, None)
    for out, inner in [(1032, 255), (17, 33), (48, 45), (64, 32), (1, 3)]:
        torch.manual_seed(4)
        weight, bias = torch.randn(out, inner) * 0.1, torch.randn(out)
        panels = layouts.panels(weight.bfloat16(), 2)
        x, residual = torch.randn(70, inner), torch.randn(70, out)
        y = bf16_kernels.call(amx, x, panels, bias, residual, out, True, 1)
        assert torch.equal(bf16_kernels.call(amx, x, panels, bias, residual, out, True, 2), y)
        theirs = bf16_kernels.call(avx512, x, panels, bias, residual, out, True, 1)
        scale = F.linear(x.bfloat16().float().abs(), weight.bfloat16().float().abs()) + 1
        assert ((y - theirs).abs() <= 2**-16 * (scale + residual.abs())).all()
        for first, rows in [(0, 1), (5, 11), (17, 16), (3, 17), (0, 49), (31, 2), (40, 30)]:
            part = slice(first, first + rows)
            alone = bf16_kernels.call(amx, x[part], panels, bias, residual[part], out, True, 1)
            assert torch.equal(alone, y[part])

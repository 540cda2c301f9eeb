"""Our kernels per instruction set (beamplugin/kernels/instruction_sets.py): the set chosen from
the CPU's features or BEAMPLUGIN_ISA, libraries built with each set's own flags, the same bytes
from every set that fuses multiply-adds (AVX-512, AVX2 and, cross-compiled and run under qemu,
NEON), NEON's tiles without spills, --int8's weights of 8 bits wherever our kernel sums them;
and the trials against torch's kernels
(beamplugin/kernels/trials.py): decided once, kept on disk, obeyed by later processes."""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from beamplugin.kernels import float_products, instruction_sets, native_library, trials
from beamplugin.kernels.instruction_sets import AVX2, AVX512, GENERIC, NEON, SETS
from beamplugin.kernels.trials import Trial
from beamplugin.modules import packed_weights

CC = os.environ.get("CC", "cc")
CROSS = "aarch64-linux-gnu-gcc"  # Debian's gcc-aarch64-linux-gnu (make test installs it)
QEMU = "qemu-aarch64"  # Debian's qemu-user
HARNESS = Path(__file__).with_name("native_harness.c")
# the float kernels the harness runs
KERNELS = ["products", "attention", "candidates", "log_softmax"]
needs_compiler = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler here")
needs_cross = pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None,
    reason="no AArch64 cross-compiler and qemu here (make test installs them)",
)


def harness_output(compiler: str, isa: instruction_sets.InstructionSet, folder: Path,
                   run: list[str] | None = None) -> bytes:  # fmt: skip
    """The harness built with ``compiler`` for ``isa`` (its flags as our libraries get them,
    every extension included) and run (under ``run``, e.g. qemu): its output bytes."""
    features = frozenset(feature for feature, _ in isa.extensions)
    flags = [f for f in native_library.FLAGS if f not in ("-shared", "-fPIC")]
    flags += instruction_sets.build_flags(isa, features)
    sources = [str(native_library.SOURCES / f"{name}.c") for name in KERNELS]
    program = folder / f"harness-{isa.name}-{Path(compiler).name}"
    static = ["-static"] if run else []
    built = subprocess.run([compiler, *flags, *static, "-o", str(program), str(HARNESS), *sources,
                            "-lm"], capture_output=True, text=True)  # fmt: skip
    assert built.returncode == 0, built.stderr
    done = subprocess.run([*(run or []), str(program)], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) > 1_000_000
    return done.stdout


@pytest.fixture(scope="module")
def native_output(tmp_path_factory):
    """harness_output of this machine's compiler, built and run once a set for the module (the
    two tests below compare the same AVX2 and generic outputs)."""
    folder = tmp_path_factory.mktemp("harness")
    return functools.cache(lambda isa: harness_output(CC, isa, folder))


@needs_compiler
def test_every_set_this_cpu_runs_gives_the_same_bytes(native_output):
    fused = [isa for isa in (AVX512, AVX2) if instruction_sets.runs_here(isa)]
    if not fused:
        pytest.skip("this CPU runs neither AVX-512 nor AVX2 code")
    outputs = {isa.name: native_output(isa) for isa in fused}
    assert len(set(outputs.values())) == 1, list(outputs)
    # generic (two roundings a multiply-add on x86-64) is its own: same shapes, other bits
    generic = native_output(GENERIC)
    assert len(generic) == len(outputs[fused[-1].name]) and generic != outputs[fused[-1].name]


@needs_cross
@pytest.mark.skipif(not instruction_sets.runs_here(AVX2), reason="this CPU cannot run AVX2")
def test_neon_gives_the_bytes_of_avx2_and_generic_those_of_x86s_generic(native_output, tmp_path):
    qemu = [QEMU, "-L", "/usr/aarch64-linux-gnu"]
    assert harness_output(CROSS, NEON, tmp_path, qemu) == native_output(AVX2)
    assert harness_output(CROSS, GENERIC, tmp_path, qemu) == native_output(GENERIC)


@needs_cross
def test_neons_register_tiles_keep_their_accumulators_in_registers(tmp_path):
    """No load or store of the stack among a NEON tile's multiply-adds (GCC 12 kept a tile's
    accumulators in memory until each row count got a function of its own)."""
    assembly = tmp_path / "products.s"
    flags = ["-O3", "-fopenmp", *instruction_sets.build_flags(NEON, frozenset())]
    source = str(native_library.SOURCES / "products.c")
    subprocess.run([CROSS, *flags, "-S", "-o", str(assembly), source], check=True)
    text = assembly.read_text()
    tiles = re.findall(r"^(tile\d):\n(.*?)\.size\t\1", text, flags=re.S | re.M)
    assert [name for name, _ in tiles] == [f"tile{r}" for r in range(1, len(tiles) + 1)]
    assert len(tiles) >= 4
    for name, body in tiles:
        lines = body.splitlines()
        fmla = [i for i, line in enumerate(lines) if "fmla" in line]
        rows = int(name[4:])  # 16 columns a tile: four vectors a row, in each copy of the loop
        assert fmla and len(fmla) % (4 * rows) == 0, name
        loops = [fmla[i : i + 4 * rows] for i in range(0, len(fmla), 4 * rows)]
        for loop in loops:
            assert not [line for line in lines[loop[0] : loop[-1] + 1] if "[sp" in line], name


def test_the_set_is_the_best_the_cpu_runs_or_the_one_named(kernels_for, caplog):
    best = next(isa for isa in SETS if instruction_sets.runs_here(isa))
    with caplog.at_level(logging.INFO, logger="beamplugin.kernels"):
        kernels_for("")
        assert instruction_sets.chosen() == best
        assert f"native kernels for {best.name}" in caplog.text
        kernels_for("off")
        assert instruction_sets.chosen() is None
    kernels_for("nope")
    with pytest.raises(ValueError, match="avx512, avx2, neon, generic, amx or off"):
        instruction_sets.chosen()
    if not instruction_sets.AMX_FEATURES <= instruction_sets.cpu_features():
        with caplog.at_level(logging.WARNING, logger="beamplugin.kernels"):
            kernels_for("amx")  # avx512 with AMX's bfloat16 products: none without AMX
            assert instruction_sets.chosen() is None
        assert "BEAMPLUGIN_ISA=amx, but this CPU lacks" in caplog.text
    elif instruction_sets.runs_here(AVX512):
        kernels_for("amx")
        assert instruction_sets.chosen() == AVX512 and instruction_sets.amx_allowed()
    elsewhere = NEON if instruction_sets.runs_here(AVX2) else AVX2  # a set this CPU lacks
    with caplog.at_level(logging.WARNING, logger="beamplugin.kernels"):
        kernels_for(elsewhere.name)
        assert instruction_sets.chosen() is None
    assert f"BEAMPLUGIN_ISA={elsewhere.name}, but this CPU lacks" in caplog.text


def test_what_a_cpu_runs_follows_its_features():
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"}
    zen3 = frozenset(v3 | {"sse4_2"})
    zen4 = zen3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
    if platform.machine() in AVX2.machines:
        assert instruction_sets.runs_here(AVX2, zen3)
        assert not instruction_sets.runs_here(AVX512, zen3)
        assert instruction_sets.runs_here(AVX512, zen4)
        assert not instruction_sets.runs_here(AVX2, zen3 - {"fma"})
    assert "-mavx512vnni" in instruction_sets.build_flags(AVX512, zen4)
    assert "-mavx512bf16" not in instruction_sets.build_flags(AVX512, zen4)
    assert instruction_sets.build_flags(AVX2, zen4)[0] == "-march=x86-64-v3"


@needs_compiler
@pytest.mark.skipif(not instruction_sets.runs_here(AVX2), reason="this CPU cannot run AVX2")
def test_a_pinned_set_builds_its_own_libraries(kernels_for, tmp_path, monkeypatch):
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    kernels_for("avx2")
    assert native_library.built_for("products") == "avx2"
    assert native_library.built_for("int8_products") == "avx2"
    assert {p.name.split("-")[1] for p in tmp_path.glob("*.so")} == {"avx2"}
    kernels_for("off")
    assert native_library.built_for("products") == "off"
    assert not float_products.available()


class Counted:
    """A trial that counts how often it is made."""

    def __init__(self, ours_seconds: float, torchs_seconds: float) -> None:
        self.made = 0
        self.seconds = ours_seconds, torchs_seconds

    def __call__(self) -> Trial:
        self.made += 1
        ours, torchs = (functools.partial(time.sleep, s) for s in self.seconds)
        return Trial(ours, torchs, [()])


def test_a_verdict_is_timed_once_kept_on_disk_and_obeyed(kernels_for, tmp_path, monkeypatch,
                                                          caplog):  # fmt: skip
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    kernels_for("")  # not pinned: timed
    faster = Counted(0.0, 0.0005)
    assert trials.ours_is_faster("demo", (3, 4), faster)
    assert trials.ours_is_faster("demo", (3, 4), faster) and faster.made == 1
    kept = list(tmp_path.glob("trials/*/demo-3x4.txt"))
    assert len(kept) == 1 and kept[0].read_text().startswith("ours ")
    # a later process reads the verdict and times nothing, whatever its own timing would say
    native_library.forget()
    kept[0].write_text("torch 1.300 1.300\n")
    with caplog.at_level(logging.INFO, logger="beamplugin.kernels"):
        assert not trials.ours_is_faster("demo", (3, 4), faster)
    assert faster.made == 1 and "demo (3, 4): torch's kernel, ours took x1.300" in caplog.text
    slower = Counted(0.0005, 0.0)
    assert not trials.ours_is_faster("demo", (5,), slower) and slower.made == 1
    kernels_for("generic")  # pinned: ours, nothing timed
    assert trials.ours_is_faster("demo", (6,), slower) and slower.made == 1


def test_a_trial_that_finds_torch_faster_is_timed_again(kernels_for, tmp_path, monkeypatch):
    """A burst of other work during a trial (ours slowed for its first rounds only) does not
    hand the kernel to torch: a verdict for torch is timed again, each side's fastest kept."""
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    kernels_for("")
    calls = []

    def ours() -> None:  # the first attempt's 11 calls slowed (warm, count, 9 rounds)
        calls.append(1)
        time.sleep(0.002 if len(calls) <= 11 else 0.0)

    trial = Trial(ours, functools.partial(time.sleep, 0.0005), [()])
    assert trials.ours_is_faster("noisy", (1,), lambda: trial)
    assert len(calls) > 11
    (kept,) = tmp_path.glob("trials/*/noisy-1.txt")
    assert kept.read_text().startswith("ours ")


@needs_compiler
def test_a_weight_whose_verdict_is_torchs_is_laid_out_for_torch(kernels_for, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """The products of a shape torch won are oneDNN's (the same as F.linear up to rounding),
    and the transformer's one-call step is not built on them."""
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    kernels_for("")
    weight = torch.randn(96, 40)
    folder = tmp_path / "trials"
    assert isinstance(packed_weights.pack_weight(weight), float_products.Panels)  # ours wins here
    (verdict,) = folder.glob("*/products-torch.float32x96x40.txt")
    verdict.write_text("torch 1.5 1.5\n")
    native_library.forget()
    packed = packed_weights.pack_weight(weight)
    assert isinstance(packed, torch.Tensor) and not isinstance(packed, float_products.Panels)
    x = torch.randn(7, 40)
    with torch.no_grad():
        out = packed_weights.packed_product(x, packed, None)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("ours", ["off", "avx2"])
def test_int8_sums_are_exact_with_8_bit_weights_wherever_they_can_be(ours):
    """oneDNN capped at AVX2 (as on a CPU without VNNI, or in oneDNN's AVX2 code on some CPUs)
    may saturate 8-bit weights' sums: with our kernels off the probe picks 8-bit weights where
    torch's sums are exact and 7-bit ones where not; our AVX2 kernel sums 8-bit weights
    exactly, so with it weights have 8 bits whatever torch's do. Exact products either way."""
    if ours == "avx2" and not instruction_sets.runs_here(instruction_sets.AVX2):
        pytest.skip("this CPU cannot run AVX2 code")
    code = textwrap.dedent("""
        import torch
        from beamplugin.modules.int8_weights import int8_linear, int8_weight_levels, pack_int8
        full = torch.full((5, 256), 127, dtype=torch.int8)
        print(torch._int_mm(full, full.t())[0, 0].item() == 127 * 127 * 256)
        print(int8_weight_levels())
        torch.manual_seed(0)
        weight, x = torch.randn(3992, 256), torch.randn(64, 256)
        packed = pack_int8(weight, None)
        out = int8_linear(x, packed)
        scale = x.abs().amax(1, keepdim=True) / 127
        values = torch.round(weight / packed.scales[:, None])  # the weight's integers
        exact = (torch.round(x / scale).double() @ values.double().t()
                 * packed.scales.double() * scale.double())
        print(bool(((out.double() - exact).abs() <= 1e-6 * exact.abs() + 1e-5).all()))
        print(torch.equal(int8_linear(x[3:4], packed), out[3:4]))
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "BEAMPLUGIN_ISA": ours}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    eight_bits = ours == "avx2" or out[0] == "True"
    assert out[1:] == ["127" if eight_bits else "63", "True", "True"], out

"""Our float32 product kernel (beamplugin/kernels/native/products.c): built here for this CPU,
the products of F.linear up to rounding, a row's bits independent of the rows beside it and of
the threads, its relu and residual as the unfused operations give them; and torch's kernels
where it cannot be built."""

import logging

import pytest
import torch
import torch.nn.functional as F

from beamplugin.kernels import float_products, instruction_sets, native_library
from beamplugin.modules import packed_weights

pytestmark = pytest.mark.exact  # run again per instruction set by make test

needs_compiler = pytest.mark.skipif(
    not float_products.available(), reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)"
)

# (out, in): an output projection not a multiple of the 32-wide panels, attention and
# feed-forward shapes, a convolution's frame windows, and odd sizes
SHAPES = [(1032, 256), (256, 256), (1024, 256), (256, 1024), (512, 768), (37, 100), (1, 3)]


def weights(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(shape) * 0.1, torch.randn(shape[0])


@needs_compiler
def test_the_kernel_is_built_and_taken_for_float32():
    assert float_products.available()
    assert torch.float32 in packed_weights.packed_dtypes()
    assert isinstance(packed_weights.pack_weight(torch.randn(40, 8)), float_products.Panels)


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_products_equal_f_linear_up_to_rounding(shape):
    weight, bias = weights(shape)
    packed = float_products.pack(weight)
    for rows in (1, 5, 37, 320):
        x = torch.randn(rows, shape[1])
        out = float_products.product(x, packed, bias)
        expected = F.linear(x.double(), weight.double(), bias.double())
        assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    no_bias = float_products.product(x, packed, None)
    torch.testing.assert_close(no_bias.double(), expected - bias.double(), rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES[:5], ids=str)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(shape):
    weight, bias = weights(shape, seed=1)
    packed = float_products.pack(weight)
    x = torch.randn(320, shape[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = float_products.product(x, packed, bias)
        torch.set_num_threads(2)
        assert torch.equal(float_products.product(x, packed, bias), everything)
        for rows in [*range(1, 18), 40, 321 - 1]:
            assert torch.equal(float_products.product(x[:rows], packed, bias), everything[:rows])
        # and from the middle of a batch
        assert torch.equal(float_products.product(x[7:12], packed, bias), everything[7:12])
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_relu_and_residual_are_the_unfused_operations_bit_for_bit():
    weight, bias = weights((1032, 256), seed=2)
    packed = float_products.pack(weight)
    x, residual = torch.randn(13, 256), torch.randn(13, 1032)
    plain = float_products.product(x, packed, bias)
    assert torch.equal(float_products.product(x, packed, bias, relu=True), plain.relu())
    assert torch.equal(float_products.product(x, packed, bias, residual=residual), plain + residual)
    assert (plain < 0).any()  # the relu had something to do


@needs_compiler
def test_strided_inputs_and_a_wrong_width():
    weight, bias = weights((64, 48), seed=3)
    packed = float_products.pack(weight)
    wide = torch.randn(9, 100)
    x = wide[:, 10:58]  # rows 100 floats apart
    residual = torch.randn(64, 9).t()  # columns contiguous: copied first
    out = float_products.product(x, packed, bias, residual=residual)
    assert torch.equal(out, float_products.product(x.contiguous(), packed, bias) + residual)
    with pytest.raises(ValueError, match="48"):
        float_products.product(torch.randn(3, 47), packed, bias)
    # what the kernel would read past, refused
    with pytest.raises(ValueError, match="residual"):
        float_products.product(x, packed, bias, residual=torch.randn(9, 63))
    with pytest.raises(ValueError, match="64 .*elements"):
        float_products.product(x, packed, bias[:-1])
    with pytest.raises(ValueError, match="64 .*elements"):
        float_products.product(x, packed, bias, norm=(torch.ones(32), torch.zeros(64), 1e-5))
    with pytest.raises(ValueError, match="float32"):
        float_products.product(x.double(), packed, bias)
    with pytest.raises(ValueError, match="2-D"):
        float_products.product(x[None], packed, bias)


@needs_compiler
def test_the_library_is_compiled_once_into_the_cache(tmp_path, monkeypatch, caplog):
    """The first library asked for builds every source of the set at once; later processes load
    them, building nothing."""
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    native_library.forget()
    try:
        with caplog.at_level(logging.INFO, logger=native_library.__name__):
            assert native_library.load("products") is not None
        built = sorted(tmp_path.glob("*.so"))
        sources = sorted(native_library.SOURCES.glob("*.c"))
        assert [p.name.split("-")[0] for p in built] == [s.stem for s in sources]
        assert "compiled products.c" in caplog.text
        stamps = [p.stat().st_mtime_ns for p in built]
        native_library.forget()  # a new process: loaded, not built
        assert native_library.load("products") is not None
        assert native_library.load("attention") is not None
        assert [p.stat().st_mtime_ns for p in sorted(tmp_path.glob("*.so"))] == stamps
        assert len(list(tmp_path.iterdir())) == len(sources)
    finally:
        monkeypatch.undo()
        native_library.forget()


@pytest.mark.parametrize("how", ["switched off", "no compiler", "compiler fails"])
def test_without_the_kernel_products_take_torchs(how, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    monkeypatch.delenv(instruction_sets.CHOICE, raising=False)  # make test's own runs
    if how == "switched off":
        monkeypatch.setenv(instruction_sets.CHOICE, "off")
    elif how == "no compiler":
        monkeypatch.setenv("CC", "no-such-compiler")
    else:
        fails = tmp_path / "cc"
        fails.write_text(
            "#!/bin/sh\n[ \"$1\" = --version ] && echo 'cc 1.0' && exit 0\n"
            "echo 'cc: fatal error: out of luck' >&2\nexit 1\n"
        )
        fails.chmod(0o755)
        monkeypatch.setenv("CC", str(fails))
    native_library.forget()
    try:
        with caplog.at_level(logging.INFO, logger="beamplugin.kernels"):
            assert not float_products.available()
        expected = {"switched off": "BEAMPLUGIN_ISA=off", "no compiler": "no C compiler",
                    "compiler fails": "out of luck"}[how]  # fmt: skip
        assert expected in caplog.text
        weight, bias = weights((1032, 256), seed=4)
        packed = packed_weights.pack_weight(weight)
        assert not isinstance(packed, float_products.Panels)
        x = torch.randn(5, 256)
        with torch.no_grad():
            out = packed_weights.packed_product(x, packed, bias)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="unavailable"):
            float_products.product(x, float_products.pack(weight), bias)
    finally:
        monkeypatch.undo()
        native_library.forget()


@needs_compiler
def test_a_layer_norm_after_the_residual_is_torchs_up_to_rounding_and_keeps_a_rows_bits():
    """A post-norm transformer's sublayer output: LayerNorm(x W^T + b + residual) in one call."""
    weight, bias = weights((256, 1024), seed=5)
    packed = float_products.pack(weight)
    gamma, beta = torch.rand(256) + 0.5, torch.randn(256)
    x, residual = torch.randn(320, 1024), torch.randn(320, 256) * 3
    normed = float_products.product(x, packed, bias, residual, norm=(gamma, beta, 1e-5))
    plain = float_products.product(x, packed, bias, residual)
    expected = F.layer_norm(plain.double(), (256,), gamma.double(), beta.double(), 1e-5)
    torch.testing.assert_close(normed.double(), expected, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for rows in (1, 5, 9, 320):
            alone = float_products.product(
                x[:rows], packed, bias, residual[:rows], norm=(gamma, beta, 1e-5)
            )
            assert torch.equal(alone, normed[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_the_layer_norm_is_a_products_post_norm_bit_for_bit():
    torch.manual_seed(5)
    x, weight, bias = torch.randn(7, 40) * 3, torch.randn(40), torch.randn(40)
    normed = float_products.layer_norm(x, weight, bias, 1e-5)
    identity = float_products.pack(torch.eye(40))  # x exactly, then the product's post-norm
    fused = float_products.product(x, identity, None, norm=(weight, bias, 1e-5))
    assert torch.equal(normed, fused)
    expected = F.layer_norm(x, (40,), weight, bias, 1e-5)
    torch.testing.assert_close(normed, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="40"):
        float_products.layer_norm(x, weight[:39], bias, 1e-5)

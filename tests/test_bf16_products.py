"""Our bfloat16 kernel (beamplugin/kernels/native/float_products.c, AVX512-BF16 CPUs): products
within bfloat16's rounding of float64's, a row's bits independent of its batch and the threads,
relu as the unfused operation gives it, the residual added before the one rounding."""

import pytest
import torch
import torch.nn.functional as F

from beamplugin.kernels import float_products
from beamplugin.modules import packed_weights

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


# --bf16: float32 rows on bfloat16 weights (float_products.Bf16Weights)
needs_weights_kernel = pytest.mark.skipif(
    not float_products.bf16_weights_available(), reason="no AVX512-BF16 or no C compiler here"
)


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


@needs_weights_kernel
@pytest.mark.parametrize("shape", [(1032, 256), (256, 1024), (37, 101), (1, 3)], ids=str)
def test_float32_rows_on_bfloat16_weights_give_vdpbf16ps_bits(shape):
    torch.manual_seed(2)
    weight, bias = torch.randn(shape) * 0.1, torch.randn(shape[0])
    packed = float_products.pack_bf16_weights(weight)
    x, residual = torch.randn(13, shape[1]), torch.randn(13, shape[0])
    out = float_products.product(x, packed, bias)
    assert out.dtype == torch.float32 and out.shape == (13, shape[0])
    assert torch.equal(out, vdpbf16ps_definition(x, weight, bias))
    assert torch.equal(float_products.product(x, packed, bias, relu=True), out.relu())
    assert torch.equal(float_products.product(x, packed, bias, residual=residual), out + residual)
    channels = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
    picked = float_products.columns(packed, channels)
    assert isinstance(picked, float_products.Bf16Weights)
    assert torch.equal(float_products.product(x, picked, bias[channels]), out[:, channels])


@needs_weights_kernel
def test_a_float32_rows_bits_on_bfloat16_weights_do_not_depend_on_its_batch_or_the_threads():
    torch.manual_seed(3)
    weight, bias = torch.randn(1032, 256) * 0.1, torch.randn(1032)
    packed = float_products.pack_bf16_weights(weight)
    x = torch.randn(321, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = float_products.product(x, packed, bias)
        torch.set_num_threads(2)
        assert torch.equal(float_products.product(x, packed, bias), everything)
        for rows in (1, 5, 11, 12, 13, 59, 60, 61, 200):
            assert torch.equal(float_products.product(x[:rows], packed, bias), everything[:rows])
        assert torch.equal(float_products.product(x[7:70], packed, bias), everything[7:70])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="float32"):
        float_products.product(x.bfloat16(), packed, bias)
    with pytest.raises(ValueError, match="256"):
        float_products.product(torch.randn(2, 255), packed, bias)

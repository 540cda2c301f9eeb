"""Our int8 kernel (beamplugin/kernels/native/int8_products.c, AVX512-VNNI and AVX2): the bits of
torch's int8 path (beamplugin.modules.int8_weights.int8_linear without panels), relu and residual
included, for any rows; and torch's path where the CPU or the machine cannot run it."""

import pytest
import torch

from beamplugin.kernels import int8_products
from beamplugin.modules import int8_weights

pytestmark = pytest.mark.exact  # run again per instruction set by make test

needs_kernel = pytest.mark.skipif(
    not int8_products.available(), reason="no int8 kernel for this set, or no C compiler here"
)
SHAPES = [(1032, 256), (256, 256), (256, 1024), (37, 101), (1, 3)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_gives_torchs_int8_bits(shape):
    torch.manual_seed(0)
    weight, bias = torch.randn(shape) * 0.1, torch.randn(shape[0])
    ours = int8_weights.pack_int8(weight, bias)
    assert ours.panels is not None and ours.values is None  # only our kernel reads them
    torchs = ours._replace(panels=None, values=_integers(weight, ours))
    for rows in (1, 5, 9, 37, 320):
        x = torch.randn(rows, shape[1]) * 3
        x[0, : min(3, shape[1])] = torch.tensor([0.5, -1.5, 2.5])[: shape[1]] * (
            x[0].abs().max() / 127
        )  # quantization ties: rounded half to even by both
        x[-1] = 0.0  # a zero row: the smallest scale
        residual = torch.randn(rows, shape[0])
        assert torch.equal(int8_weights.int8_linear(x, ours), int8_weights.int8_linear(x, torchs))
        relu = int8_weights.int8_linear(x, ours, relu=True)
        assert torch.equal(relu, int8_weights.int8_linear(x, torchs, relu=True))
        summed = int8_weights.int8_linear(x, ours, residual=residual)
        assert torch.equal(summed, int8_weights.int8_linear(x, torchs, residual=residual))
    no_bias = int8_weights.pack_int8(weight, None)
    plain = no_bias._replace(panels=None, values=_integers(weight, no_bias))
    assert torch.equal(int8_weights.int8_linear(x, no_bias), int8_weights.int8_linear(x, plain))


def _integers(weight: torch.Tensor, packed: int8_weights.Int8Weight) -> torch.Tensor:
    """The int8 values pack_int8 quantized ``weight`` to (its scales per output channel)."""
    return torch.round(weight / packed.scales[:, None]).to(torch.int8)


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads():
    torch.manual_seed(1)
    ours = int8_weights.pack_int8(torch.randn(1032, 256) * 0.1, torch.randn(1032))
    x = torch.randn(320, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = int8_weights.int8_linear(x, ours)
        torch.set_num_threads(2)
        assert torch.equal(int8_weights.int8_linear(x, ours), everything)
        for rows in (1, 2, 7, 8, 9, 40):
            assert torch.equal(int8_weights.int8_linear(x[:rows], ours), everything[:rows])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="256"):
        int8_products.product(torch.randn(2, 255), ours.panels, ours.scales, None, 1e-30)


def test_without_the_kernel_int8_takes_torchs_path(kernels_for):
    kernels_for("off")
    torch.manual_seed(2)
    weight = torch.randn(64, 32)
    packed = int8_weights.pack_int8(weight, None)
    assert packed.panels is None
    x = torch.randn(3, 32)
    expected = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(int8_weights.int8_linear(x, packed), expected, rtol=0.05, atol=0.2)

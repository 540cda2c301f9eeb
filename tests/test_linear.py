"""The model's products: on a packed weight (our kernel's panels, or oneDNN's layout) on CPU
without autograd, with the packing kept by the modules; F.linear otherwise; the same results up
to rounding. Only the tests of oneDNN's own path need oneDNN; the rest run on our kernel."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from beamplugin.kernels import float_products
from beamplugin.modules import prepared_linear
from beamplugin.modules.linear import Linear
from beamplugin.modules.packed_weights import (
    ONEDNN_DTYPES,
    onednn_layout,
    packed_dtypes,
    packed_product,
    uses_packed_products,
)
from beamplugin.modules.prepared_linear import prepare_linear
from beamplugin.modules.weight_norm import WeightNormLinear

needs_onednn = pytest.mark.skipif(
    torch.float32 not in ONEDNN_DTYPES, reason="this torch build has no oneDNN"
)

VOCABULARY = 1032  # an output projection's rows
# Half precisions that this CPU multiplies in hardware (oneDNN packs only those)
HALF = [dtype for dtype in (torch.bfloat16, torch.float16) if dtype in ONEDNN_DTYPES]


def large_weight() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(VOCABULARY, 256) * 0.1, torch.randn(VOCABULARY)


def packed_by(kernel: str, weight: torch.Tensor) -> float_products.Panels | torch.Tensor:
    """``weight`` packed for ``kernel``: our kernel's panels, or oneDNN's layout."""
    if kernel == "oneDNN":
        return onednn_layout(weight)
    if not float_products.available(weight.dtype):
        pytest.skip(f"our product kernel is not built here for {weight.dtype}")
    return float_products.pack(weight)


KERNELS = ["ours", pytest.param("oneDNN", marks=needs_onednn)]


@pytest.fixture
def packed_float32() -> None:
    """Float32 products run on packed weights here (our kernel, or oneDNN)."""
    if torch.float32 not in packed_dtypes():
        pytest.skip("neither our product kernel nor oneDNN runs here")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 37, 320])
def test_packed_product_equals_f_linear_up_to_rounding(kernel, rows):
    weight, bias = large_weight()
    x = torch.randn(rows, 256)
    with torch.no_grad():
        out = packed_product(x, packed_by(kernel, weight), bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert out.shape == (rows, weight.size(0)) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_f_linear_where_no_packed_product_serves(packed_float32):
    weight, _ = large_weight()
    x = torch.randn(3, 256)
    small = torch.randn(256, 256)
    with torch.no_grad():
        assert uses_packed_products(x, small)  # an attention projection too: same bits for any rows
        assert not uses_packed_products(x.double(), weight.double())
    assert not uses_packed_products(x, weight)  # autograd records: no backward for either kernel


def test_gradients_flow_through_the_training_path():
    layer = Linear(256, VOCABULARY)
    x = torch.randn(4, 256, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


# The vocabulary projection, a decoder convolution and an attention projection
SHAPES = [(VOCABULARY, 256), (512, 768), (256, 256)]


@pytest.mark.parametrize(
    "kernel, shape, dtype",
    [("ours", shape, dtype) for dtype in (torch.float32, torch.bfloat16) for shape in SHAPES]
    + [pytest.param("oneDNN", shape, dtype, marks=needs_onednn)
       for dtype in [torch.float32, *HALF] for shape in SHAPES],
    ids=str,
)  # fmt: skip
def test_packed_weight_gives_the_same_bits_whatever_the_rows(kernel, shape, dtype):
    """MKL's F.linear takes other kernels for 1 to 3 rows: its bits would depend on the
    batch."""
    torch.manual_seed(0)
    weight, bias = (torch.randn(shape) * 0.1).to(dtype), torch.randn(shape[0]).to(dtype)
    packed = packed_by(kernel, weight)
    x = torch.randn(320, shape[1]).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        everything = packed_product(x, packed, bias)
        for rows in (1, 2, 5, 37):
            alone = packed_product(x[:rows], packed, bias)
            assert torch.equal(alone, everything[:rows])  # a row's result ignores the batch
            plain = F.linear(x[:rows].float(), weight.float(), bias.float())
            torch.testing.assert_close(alone.float(), plain, rtol=tolerance, atol=tolerance)


def packings(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The weights packed from now on, as the products ask for them."""
    packed = []
    pack = prepared_linear.pack_weight
    monkeypatch.setattr(prepared_linear, "pack_weight", lambda w: packed.append(w) or pack(w))
    return packed


@pytest.mark.parametrize("module", ["Linear", "WeightNormLinear"])
def test_modules_keep_the_packed_weight_until_parameters_change(
    module, monkeypatch, packed_float32
):
    """A module packs its weight once, multiplies on it with the bits of a product prepared
    from the same weight, and packs again only when its parameters change (an optimizer's
    write, a state dict load) or in a copy or pickle of it."""
    torch.manual_seed(1)
    layer = (Linear if module == "Linear" else WeightNormLinear)(256, VOCABULARY).eval()
    x = torch.randn(5, 256)
    packed = packings(monkeypatch)
    with torch.no_grad():
        first = layer(x)
        assert torch.equal(layer(x), first) and len(packed) == 1
        torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias))
        # copies and pickles leave the packed (uncopyable) tensor out and pack again
        assert torch.equal(copy.deepcopy(layer)(x), first)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), first)
        assert len(packed) == 3
        assert torch.equal(first, prepare_linear(layer.weight, layer.bias)(x))
        del packed[:]
        # fairseq's optimizers write through .data between train() and eval()
        layer.train()
        parameter = layer.weight if module == "Linear" else layer.weight_v
        parameter.data.mul_(2)
        layer.eval()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(packed) == 1
        # a state dict load bumps the versions
        layer.load_state_dict({k: v * 0.5 for k, v in layer.state_dict().items()})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert len(packed) == 2

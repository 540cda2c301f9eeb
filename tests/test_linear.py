"""The model's products: oneDNN on CPU without autograd (with a packed weight the modules keep),
F.linear otherwise, and the same results up to rounding."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from beamplugin.modules import packed_weights
from beamplugin.modules.linear import Linear
from beamplugin.modules.packed_weights import pack_weight, packed_product, uses_packed_products
from beamplugin.modules.prepared_linear import prepare_linear
from beamplugin.modules.weight_norm import WeightNormLinear

needs_onednn = pytest.mark.skipif(
    packed_weights._onednn_linear is None or packed_weights._onednn_pack is None,
    reason="this torch build has no oneDNN (or no packing for it)",
)


VOCABULARY = 1032  # an output projection's rows


def large_weight() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    out_features = VOCABULARY
    return torch.randn(out_features, 256) * 0.1, torch.randn(out_features)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 37, 320])
def test_onednn_product_equals_f_linear_up_to_rounding(rows):
    weight, bias = large_weight()
    x = torch.randn(rows, 1, 256)
    with torch.no_grad():
        assert uses_packed_products(x, weight)
        out = prepare_linear(weight, bias)(x.reshape(rows, 256)).view(rows, 1, -1)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert out.shape == (rows, 1, weight.size(0)) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_f_linear_only_where_onednn_cannot_serve():
    weight, _ = large_weight()
    x = torch.randn(3, 256)
    small = torch.randn(256, 256)
    with torch.no_grad():
        assert uses_packed_products(x, small)  # an attention projection too: same bits for any rows
        assert not uses_packed_products(x.double(), weight.double())
    assert not uses_packed_products(x, weight)  # autograd records: oneDNN has no backward


def test_gradients_flow_through_the_training_path():
    layer = Linear(256, VOCABULARY)
    x = torch.randn(4, 256, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


# Half precisions that this CPU multiplies in hardware (oneDNN packs only those)
HALF = [dtype for dtype in (torch.bfloat16, torch.float16) if dtype in packed_weights.ONEDNN_DTYPES]


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 37, 320])
@pytest.mark.parametrize(
    "shape, dtype",
    [((VOCABULARY, 256), torch.float32), ((512, 768), torch.float32), ((256, 256), torch.float32)]
    + [((512, 768), dtype) for dtype in HALF] + [((256, 256), dtype) for dtype in HALF],
    ids=str,
)  # fmt: skip
def test_packed_weight_gives_the_same_bits_whatever_the_rows(rows, shape, dtype):
    """The vocabulary projection, a decoder convolution and an attention projection (MKL's
    F.linear takes other kernels for 1 to 3 rows: its bits would depend on the batch)."""
    torch.manual_seed(0)
    weight, bias = (torch.randn(shape) * 0.1).to(dtype), torch.randn(shape[0]).to(dtype)
    packed = pack_weight(weight)
    x = torch.randn(320, shape[1]).to(dtype)
    with torch.no_grad():
        assert uses_packed_products(x, weight)
        everything = packed_product(x, packed, bias)
        alone = packed_product(x[:rows], packed, bias)
        plain = prepare_linear(weight, bias)(x[:rows])
    assert torch.equal(alone, everything[:rows])  # a row's result does not depend on the batch
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone, plain, rtol=tolerance, atol=tolerance)


@needs_onednn
@pytest.mark.parametrize("module", ["Linear", "WeightNormLinear"])
def test_modules_keep_the_packed_weight_until_parameters_change(module):
    torch.manual_seed(1)
    out_features = VOCABULARY
    layer = (Linear if module == "Linear" else WeightNormLinear)(256, out_features).eval()
    x = torch.randn(5, 256)
    with torch.no_grad():
        first = layer(x)
        assert any(name.endswith("packed") for name in layer._cache)
        torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias))
        # copies and pickles leave the packed (uncopyable) tensor out and recompute it
        assert torch.equal(copy.deepcopy(layer)(x), first)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), first)
        # fairseq's optimizers write through .data between train() and eval()
        layer.train()
        parameter = layer.weight if module == "Linear" else layer.weight_v
        parameter.data.mul_(2)
        layer.eval()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        # a state dict load bumps the versions
        layer.load_state_dict({k: v * 0.5 for k, v in layer.state_dict().items()})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))

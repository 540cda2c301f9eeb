"""int8 products (--int8, CPU): each row of activations is quantized with its own scale and the
weights per output channel (the encoder's convolutions too, one window of frames per row), so a
sentence decodes as it does alone, whatever shares its step: in one batch, and on the continuous
engine with refills. Where torch's int8 path sums pairs of products in 16 bits (oneDNN without
VNNI) and our kernel does not run, weights have 7 bits: forced here on any CPU (the probe itself:
tests/test_instruction_sets.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from builders import (
    BUILDERS,
    ORDERS,
    alone,
    assert_identical,
    assert_same,
    build_transformer,
    make_batch,
    stream,
)
from precision_bounds import N_SENTENCES, SCORE_TOLERANCE

from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.modules import int8_weights, prepared_linear
from beamplugin.modules.convolution import CausalConvolution, TBCConvolution
from beamplugin.modules.int8_weights import int8_linear, int8_weight_levels, pack_int8

# vocab, one_thread and sentences: conftest.py's module-scoped fixtures
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]

# The weight levels to test: this CPU's, and the 7-bit fallback of CPUs without VNNI (exact on
# every CPU; full 8-bit weights are not exact without VNNI, so never forced).
LEVELS = sorted({int8_weight_levels(), 63})


@pytest.fixture(scope="module")
def convs2s(vocab):
    return BUILDERS["convs2s"](vocab, 1)


@pytest.fixture
def levels(request, monkeypatch) -> int:
    monkeypatch.setattr(int8_weights, "int8_weight_levels", lambda: request.param)
    return request.param


def in_int8(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A copy of ``model`` with every product in int8 (the test models' weights are all below
    INT8_MIN_WEIGHTS)."""
    monkeypatch.setattr(int8_weights, "INT8_MIN_WEIGHTS", 0)
    model = copy.deepcopy(model)
    assert cast_for_decoding([model], "int8") == torch.float32
    return model


@pytest.mark.parametrize("levels", LEVELS, indirect=True)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_product_is_f_linear_within_quantization_error(levels, rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(600, 256) * 0.1, torch.randn(600), torch.randn(rows, 1, 256)
    out = int8_linear(x, pack_int8(weight, bias))
    expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == torch.float32
    # measured: 0.8% of the output's norm with 8-bit weights, 1.4% with 7-bit ones
    bound = 0.012 if levels == 127 else 0.02
    assert 0 < (out - expected).norm() / expected.norm() < bound


@pytest.mark.parametrize("levels", LEVELS, indirect=True)
def test_int8_product_of_a_row_does_not_depend_on_the_other_rows(levels):
    torch.manual_seed(0)
    weight, bias = torch.randn(3992, 256) * 0.1, torch.randn(3992)
    packed = pack_int8(weight, bias)
    # the weight's integers: per output channel, max |w| at +-levels
    values = torch.round(weight / packed.scales[:, None])
    assert values.abs().max() == levels
    assert torch.equal(packed.scales, weight.abs().amax(1) / levels)
    x = torch.randn(320, 256)
    x[7] *= 1000  # a batch-mate with huge activations: a shared scale would crush the others
    x[9] = 0  # and a zero row (padding)
    everything = int8_linear(x, packed)
    for first, last in [(0, 1), (5, 6), (8, 9), (9, 10), (3, 40), (100, 320)]:
        assert torch.equal(int8_linear(x[first:last], packed), everything[first:last])
    assert torch.equal(everything[9], bias)
    # the integer sums are exact: the result is that of float64 arithmetic on the same integers
    scale = (x.abs().amax(1, keepdim=True) / 127).clamp(min=1e-30)
    quantized = torch.round(x / scale).double()
    exact = quantized @ values.double().t() * packed.scales.double() * scale.double()
    torch.testing.assert_close(everything.double(), exact + bias.double(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("levels", LEVELS, indirect=True)
@pytest.mark.parametrize("kind", ["centred", "causal", "width 4", "width 1"])
def test_int8_convolution_is_conv_tbc_within_quantization_error_and_per_sentence(
    kind, levels, monkeypatch
):
    """Under int8 the encoder's convolutions (and the decoder's full pass) multiply every
    output frame's window of input frames by the linearized weight, one quantization scale per
    window: a sentence's frames come out the same whatever sentences share the batch."""
    monkeypatch.setattr(int8_weights, "INT8_MIN_WEIGHTS", 0)
    torch.manual_seed(2)
    width = {"width 4": 4, "width 1": 1}.get(kind, 3)
    conv = (CausalConvolution if kind == "causal" else TBCConvolution)(16, 32, width).eval()
    x = torch.randn(9, 5, 16)  # time x batch x channels
    x[:, 3] *= 100  # a batch-mate with large activations
    with torch.inference_mode():
        expected = conv(x)
        conv.int8_products = True
        out = conv(x)
        for sentence in range(5):
            assert torch.equal(conv(x[:, sentence : sentence + 1]), out[:, sentence : sentence + 1])
    assert out.shape == expected.shape
    errors = ((out - expected).norm(dim=(0, 2)) / expected.norm(dim=(0, 2))).tolist()
    # measured: 0.6-0.9% of each sentence's output norm with 8-bit weights
    assert 0 < max(errors) < (0.015 if levels == 127 else 0.025), errors


@pytest.mark.parametrize("levels", LEVELS, indirect=True)
def test_a_batch_in_int8_equals_each_sentence_alone(vocab, convs2s, levels, monkeypatch):
    model = in_int8(convs2s, monkeypatch)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    sample = make_batch(vocab, 12, seed=6)
    batched = gen.generate(None, sample)
    net_input = sample["net_input"]
    one_by_one = [
        alone(gen, row[len(row) - n :])  # without the left padding
        for row, n in zip(net_input["src_tokens"], net_input["src_lengths"].tolist(), strict=True)
    ]
    assert_identical(one_by_one, batched)


@pytest.mark.parametrize("levels", LEVELS, indirect=True)
@pytest.mark.parametrize(
    "options",
    [dict(beam_size=4), dict(beam_size=3, stopping="exact", len_penalty=0.5),
     dict(beam_size=5, nbest=2)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
def test_stream_in_int8_equals_each_sentence_alone_in_int8(
    vocab, convs2s, sentences, options, levels, arch, monkeypatch
):
    original = convs2s if arch == "convs2s" else build_transformer(vocab, 1)
    model = in_int8(original, monkeypatch)
    gen = SequenceGenerator([model], vocab, **{"max_len_b": 20, **options})
    expected = [alone(gen, s) for s in sentences]
    float32 = SequenceGenerator([original], vocab, **{"max_len_b": 20, **options})
    assert any(
        float(a[0]["score"]) != float(b[0]["score"])
        for a, b in zip(expected, [alone(float32, s) for s in sentences], strict=True)
    ), "int8 decoded exactly as float32: were its products run?"
    for order in ORDERS.values():
        for capacity in (dict(max_sentences=3), dict(max_sentences=5)):
            out, engine = stream(gen, sentences, order, window=4, **capacity)
            assert_identical(expected, out)
            assert engine.refills > 0


def test_int8_products_translate_as_float32_on_most_sentences(vocab, convs2s, monkeypatch):
    """--int8: the decoder's products in int8 (every one here: the test model is tiny), the
    rest and the search in float32."""
    sample = make_batch(vocab, N_SENTENCES, seed=3)
    options = dict(beam_size=5, max_len_b=20)
    reference = SequenceGenerator([convs2s], vocab, **options).generate(None, sample)
    model = in_int8(convs2s, monkeypatch)
    calls = []
    counted = lambda *a, **k: calls.append(1) or int8_linear(*a, **k)  # noqa: E731
    monkeypatch.setattr(prepared_linear, "int8_linear", counted)
    out = SequenceGenerator([model], vocab, **options).generate(None, sample)
    assert calls, "no int8 product was made"
    same = [
        (r[0], o[0])
        for r, o in zip(reference, out, strict=True)
        if r[0]["tokens"].tolist() == o[0]["tokens"].tolist()
    ]
    # measured: 55 of 64 equal (86%) with 8-bit weights, 52 (81%) with 7-bit ones (CPUs without
    # VNNI); scores within 0.018 and 0.027
    assert len(same) >= 0.75 * N_SENTENCES, f"{len(same)} of {N_SENTENCES} equal"
    assert 0 < max(abs(float(r["score"]) - float(o["score"])) for r, o in same) < SCORE_TOLERANCE
    cast_for_decoding([model], "float32")  # and back: every product in float32 again
    assert_same(reference, SequenceGenerator([model], vocab, **options).generate(None, sample))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_on_cuda_is_refused(convs2s):
    model = copy.deepcopy(convs2s).cuda()
    with pytest.raises(ValueError, match="int8 products run on the CPU only"):
        cast_for_decoding([model], "int8")

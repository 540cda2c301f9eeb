"""Our kernel for the attention of each sentence's rows over its one memory (ConvS2S's;
beamplugin/kernels/native/attention.c's ``sentence_attention``): softmax(bias + q keys) values
x scale up to rounding, the weights when asked, and a row's bits independent of the rows and
sentences beside it, the padding before its source and the threads."""

import math

import pytest
import torch

from beamplugin.kernels import sentence_attention
from beamplugin.modules.attention import ConvAttention, encoder_memory

pytestmark = pytest.mark.exact  # run again per instruction set by make test

needs_compiler = pytest.mark.skipif(
    sentence_attention._kernel() is None,
    reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)",
)


def memory(sentences: int, embed: int, src: int, padding: list[int], seed: int = 0):
    """Keys [sentences, embed, src], values [sentences, src, embed], a bias of -inf over each
    sentence's ``padding`` first positions and a scale a sentence."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(sentences, embed, src, generator=g)
    values = torch.randn(sentences, src, embed, generator=g)
    bias = torch.zeros(sentences, 1, src)
    for n, pad in enumerate(padding):
        bias[n, 0, :pad] = -math.inf
    scale = torch.rand(sentences, 1, 1, generator=g) + 0.5
    return keys, values, bias, scale


def attend(query, keys, values, bias, scale, need_weights=False):
    out = torch.empty(query.size(0) * query.size(1), query.size(2))
    weights = sentence_attention.attend(query, keys, values, bias, scale, out, need_weights)
    return out.view_as(query), weights


@needs_compiler
@pytest.mark.parametrize(("rows", "embed", "src"), [(5, 256, 48), (1, 256, 17), (7, 40, 33),
                                                    (13, 64, 5)])  # fmt: skip
def test_context_and_weights_are_softmax_of_the_scores_times_values_and_scale(rows, embed, src):
    sentences = 3
    keys, values, bias, scale = memory(sentences, embed, src, [0, 2, src - 1])
    query = torch.randn(sentences, rows, embed)
    context, weights = attend(query, keys, values, bias, scale, need_weights=True)
    probs = torch.softmax(torch.baddbmm(bias.double(), query.double(), keys.double()), -1)
    expected = torch.bmm(probs, values.double()) * scale.double()
    torch.testing.assert_close(context.double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weights.double(), probs, atol=1e-5, rtol=1e-4)
    assert (weights[2, :, : src - 1] == 0).all()  # padding weighs exactly 0
    no_bias, _ = attend(query[:1], keys[:1], values[:1], None, scale[:1])
    assert torch.equal(no_bias, context[:1])  # no padding: the bias of zeros' bits


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_batch_its_padding_or_the_threads(threads):
    embed, src, beam = 256, 40, 7
    keys, values, bias, scale = memory(4, embed, src, [0, 3, 9, 17], seed=1)
    query = torch.randn(4, beam, embed)
    torch.set_num_threads(threads)
    try:
        batched, _ = attend(query, keys, values, bias, scale)
    finally:
        torch.set_num_threads(1)
    for n in range(4):
        for rows in (slice(0, beam), slice(2, 3), slice(5, 7)):  # tiles start elsewhere
            alone, _ = attend(query[n : n + 1, rows].contiguous(), keys[n : n + 1],
                              values[n : n + 1], bias[n : n + 1], scale[n : n + 1])  # fmt: skip
            assert torch.equal(alone[0], batched[n, rows])
        for pad in (1, 16, 23):  # more padding before its source: wider memory
            wider = [torch.cat([torch.zeros(*shape), t[n : n + 1]], dim)
                     for t, shape, dim in ((keys, (1, embed, pad), 2),
                                           (values, (1, pad, embed), 1))]  # fmt: skip
            wide_bias = torch.cat([torch.full((1, 1, pad), -math.inf), bias[n : n + 1]], 2)
            alone, _ = attend(query[n : n + 1], *wider, wide_bias, scale[n : n + 1])
            assert torch.equal(alone[0], batched[n])


@needs_compiler
def test_conv_attention_takes_the_kernel_within_rounding_of_torchs():
    torch.manual_seed(2)
    layer = ConvAttention(64, 32).eval()
    encoder_out = torch.randn(3, 11, 32), torch.randn(3, 11, 32)
    padding = torch.zeros(3, 11, dtype=torch.bool)
    padding[1, :4] = True
    memory_ = encoder_memory({"encoder_out": encoder_out, "encoder_padding_mask": padding})
    x, target = torch.randn(15, 1, 64), torch.randn(15, 1, 32)
    with torch.inference_mode():
        ours, attn = layer(x, target, [(memory_, 15)])
    with torch.enable_grad():  # training: torch's batched products
        assert not sentence_attention.serves(x)
        torchs, torch_attn = layer(x, target, [(memory_, 15)])
    torch.testing.assert_close(ours, torchs.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn, torch_attn.detach(), atol=1e-6, rtol=1e-5)

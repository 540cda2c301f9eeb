"""A transformer decoder step, and an encoder's layers, in one call of our kernels
(beamplugin/kernels/native/transformer_layers.c): the bits of the same kernels called one at a
time (post-norm, and --bf16's bfloat16 weights), within float rounding of them (pre-norm, and
int8's post-norm: our layer norm for torch's), the calls one at a time where a layer is not
ours to run (gelu), bad inputs refused."""

from __future__ import annotations

import threading

import pytest
import torch
from builders import (
    ORDERS,
    alone,
    assert_same,
    build_transformer,
    cast_or_skip,
    make_batch,
    stream,
)
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.kernels import float_products, transformer_layers
from beamplugin.models import transformer_weights

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.exact,
    pytest.mark.skipif(
        not transformer_layers.available(),
        reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)",
    ),
]


def decode(vocab, sentences, model, monkeypatch, in_kernel: bool):
    with monkeypatch.context() as patch:
        if not in_kernel:
            patch.setattr(transformer_weights, "_in_kernel", lambda *_: None)
            patch.setattr(transformer_weights, "_encoder_in_kernel", lambda *_: None)
        gen = SequenceGenerator([model], vocab, beam_size=4, nbest=2, max_len_b=20)
        view = gen.model.models[0]
        batch = gen.generate([model], make_batch(vocab, 8, seed=3))
        assert (view.decoder.weights.decoder_in_kernel is not None) == in_kernel
        assert (view.decoder.weights.encoder_in_kernel is not None) == in_kernel
        streamed, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
        assert engine.refills > 0
    return batch, streamed


@pytest.mark.parametrize("kind", ["post-norm", "pre-norm", "int8", "bf16"])
def test_one_call_gives_the_calls_one_at_a_time(vocab, sentences, monkeypatch, kind):
    options = dict(encoder_normalize_before=True, decoder_normalize_before=True)
    model = build_transformer(vocab, 1, **(options if kind == "pre-norm" else {}))
    if kind in ("int8", "bf16"):
        cast_or_skip(model, kind, monkeypatch)
    one_call = decode(vocab, sentences, model, monkeypatch, in_kernel=True)
    if kind == "bf16":  # the step's products really on bfloat16 weights
        view = SequenceGenerator([model], vocab).model.models[0]
        with torch.inference_mode():
            view.encoder.forward_torchscript(make_batch(vocab, 1, seed=1)["net_input"])
        step = view.decoder.weights.decoder_in_kernel
        assert isinstance(step.layers[0].fc1.panels, float_products.Bf16Weights)
    one_at_a_time = decode(vocab, sentences, model, monkeypatch, in_kernel=False)
    for ours, theirs in zip([*one_call[0], *one_call[1]], [*one_at_a_time[0], *one_at_a_time[1]],
                            strict=True):  # fmt: skip
        for o, t in zip(ours, theirs, strict=True):
            assert torch.equal(o["tokens"], t["tokens"])
            if kind not in ("post-norm", "bf16"):  # our layer norm (before or after) for torch's
                torch.testing.assert_close(o["positional_scores"], t["positional_scores"],
                                           rtol=0, atol=1e-5)  # fmt: skip
            else:  # the same kernels in the same order
                assert torch.equal(o["positional_scores"], t["positional_scores"])
                assert torch.equal(o["attention"], t["attention"])


def test_a_gelu_layer_runs_one_call_at_a_time(vocab, sentences):
    model = build_transformer(vocab, 1, activation_fn="gelu")
    options = dict(beam_size=4, max_len_b=20)
    gen = SequenceGenerator([model], vocab, **options)
    sample = make_batch(vocab, 8, seed=3)
    expected = FairseqGenerator([model], vocab, **options).generate([model], sample)
    assert_same(expected, gen.generate([model], sample))
    assert gen.model.models[0].decoder.weights.decoder_in_kernel is None
    out, _ = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
    assert_same([alone(gen, s) for s in sentences], out)


def test_bad_inputs_are_refused(vocab):
    model = build_transformer(vocab, 1)
    gen = SequenceGenerator([model], vocab, beam_size=2, max_len_b=5)
    gen.generate([model], make_batch(vocab, 2, seed=1))
    layers = gen.model.models[0].decoder.weights.decoder_in_kernel
    heads, head_dim, rows, width = 2, 8, 3, 16
    tokens = torch.tensor([[2, 5, 6], [1, 2, 7], [2, 8, 9]])  # 1: pad
    windows = torch.zeros(4, 4, heads, width, head_dim)
    sources = torch.arange(rows).view(rows, 1).expand(rows, width).contiguous()
    memory = [torch.zeros(1, heads, head_dim, 16) for _ in range(2)]
    values = [torch.zeros(1, heads, 16, head_dim) for _ in range(2)]
    group = transformer_layers.Group(memory, values, torch.zeros(1, 1, 1, 16), rows)
    groups = layers.groups([group])
    logits = torch.full((rows, len(vocab)), float("nan"))
    attn = layers(tokens, windows, sources, groups, 1, None, logits)
    assert attn.shape == (rows, 16)
    assert logits.isfinite().all()  # every one written
    bad = sources.clone()
    bad[2, 5] = 4  # a slot past the history's
    with pytest.raises(ValueError, match="must be slots"):
        layers(tokens, windows, bad, groups, 1, None, logits)
    with pytest.raises(ValueError, match="token outside"):
        layers(tokens.masked_fill(tokens.eq(9), len(vocab)), windows, sources, groups, 1, None,
               logits)  # fmt: skip
    with pytest.raises(ValueError, match="add up"):
        layers(tokens, windows, sources, layers.groups([group._replace(rows=2)]), 1, None, logits)
    with pytest.raises(ValueError, match="history window"):
        layers(tokens, windows[:, :, :, :, :4], sources, groups, 1, None, logits)
    with pytest.raises(ValueError, match="layout"):
        layers.groups([group._replace(values=memory)])
    with pytest.raises(ValueError, match="int64"):
        layers(tokens.int(), windows, sources, groups, 1, None, logits)
    with pytest.raises(ValueError, match="logits must be"):
        layers(tokens, windows, sources, groups, 1, None, logits[:, :-1])
    encoder = gen.model.models[0].decoder.weights.encoder_in_kernel
    x, source_bias = torch.randn(2 * 5, 16), torch.zeros(2, 1, 1, 5)
    assert encoder(x, 2, source_bias).shape == (10, 16)
    with pytest.raises(ValueError, match="contiguous float32"):
        encoder(x.double(), 2, source_bias)
    with pytest.raises(ValueError, match="bias"):
        encoder(x, 2, torch.zeros(2, 1, 1, 4))


def test_generators_in_several_threads_take_turns_on_one_model(vocab, sentences):
    """Each engine's steps fill in the one-call step's tables of the model they share: threads
    take turns there (the C call releases the GIL), so every sentence still gets its own bits."""
    model = build_transformer(vocab, 1)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    assert gen.model.models[0].decoder.weights.decoder_in_kernel is not None
    results: dict[int, list] = {}

    def decode(first: int) -> None:
        for _ in range(3):
            for i in range(first, len(sentences), 2):
                results[i] = alone(gen, sentences[i])
                assert_same([expected[i]], [results[i]])

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, hypotheses in results.items():
        for ours, theirs in zip(hypotheses, expected[i], strict=True):
            assert torch.equal(ours["positional_scores"], theirs["positional_scores"])
    assert sorted(results) == list(range(len(sentences)))

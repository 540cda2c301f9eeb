"""The ConvS2S decoder's incremental step in one call of our kernels
(beamplugin/kernels/native/convs2s_layers.c) against the Python path (the same kernels called
one at a time): the same tokens, logits and attention within a tight tolerance (GLU's sigmoid is
ours, not torch's), over steps with beam reorders and fresh rows; a row's bits the same alone
and batched; float32, --bf16 and --int8; the Python path where it does not serve."""

from __future__ import annotations

import argparse

import pytest
import torch
from builders import (
    ORDERS,
    _Task,
    assert_identical,
    build_convs2s,
    cast_or_skip,
    make_batch,
    stream,
)

from beamplugin import SequenceGenerator
from beamplugin.kernels import convs2s_layers
from beamplugin.models.convs2s import ConvS2SModel

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not convs2s_layers.available(),
        reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)",
    ),
]

KINDS = ["float32", "bf16", "int8", "shapes"]


def build_shapes(vocab, seed: int) -> ConvS2SModel:
    """A convs2s whose decoder has every part the step handles: a residual projection (channels
    change), a 1-wide and a 2-wide convolution, a residual two layers back, no residual, and a
    layer that does not attend."""
    torch.manual_seed(seed)
    args = argparse.Namespace(
        encoder_embed_dim=16, encoder_layers="[(16, 3)] * 2", decoder_embed_dim=16,
        decoder_layers="[(16, 3), (24, 1), (24, 2, 2), (16, 3, 0), (16, 3)]",
        decoder_attention="[True, False, True, True, True]", decoder_out_embed_dim=20,
        dropout=0.0, max_source_positions=1024, max_target_positions=1024,
    )  # fmt: skip
    model = ConvS2SModel.build_model(args, _Task(vocab)).eval()
    with torch.no_grad():
        model.decoder.fc3.weight_g.mul_(10)
    return model


def model_of(kind: str, vocab, monkeypatch, seed: int = 1) -> ConvS2SModel:
    if kind == "shapes":
        return build_shapes(vocab, seed)
    model = build_convs2s(vocab, seed)
    if kind in ("int8", "bf16"):
        cast_or_skip(model, kind, monkeypatch)
    return model


def scripted_steps(model, vocab, in_kernel: bool, monkeypatch, need_attn: bool = True):
    """Logits and attention of 7 steps of 3 sentences x 2 beams: random tokens, beams reordered
    (repeated, swapped) after steps 1 and 4, and the last two rows started afresh after step 3
    (fresh_rows)."""
    decoder = model.decoder
    g = torch.Generator().manual_seed(5)
    sentences, beams = 3, 2
    rows = sentences * beams
    out = []
    with torch.inference_mode(), monkeypatch.context() as patch:
        encoder_out = model.encoder(**make_batch(vocab, sentences, seed=4)["net_input"])
        if in_kernel:
            assert convs2s_layers.step_of(decoder, torch.empty(0), []) is not None
        else:
            patch.setattr(convs2s_layers, "step_of", lambda *_: None)
        state: dict = {}
        tokens = torch.full((rows, 1), vocab.eos())
        for step in range(7):
            logits, attn = decoder(tokens, encoder_out, state, need_attn=need_attn)
            out.append((logits.clone(), None if attn is None else attn.clone()))
            new = torch.randint(vocab.nspecial, len(vocab), (rows, 1), generator=g)
            tokens = torch.cat([tokens, new], 1)
            if step in (1, 4):
                order = torch.tensor([1, 1, 2, 3, 5, 4])
                decoder.reorder_incremental_state(state, order)
                tokens = tokens.index_select(0, order)
            if step == 3:
                order = torch.tensor([0, 1, 2, 3, 0, 0])
                decoder.reorder_incremental_state(state, order, fresh_rows=2)
                tokens = tokens.index_select(0, order)
                tokens[-2:] = vocab.pad()
                tokens[-2:, -1] = vocab.eos()
    return out


# logits (sharpened: up to some 7) within: float32 rounding of GLU's sigmoid carried through the
# layers (1e-6 measured); under bf16 and int8 it may also flip a row's rounding to bfloat16 or
# int8 (measured: 0 and 5e-7 on these models)
TOLERANCE = {"float32": 1e-5, "shapes": 1e-5, "bf16": 1e-3, "int8": 1e-3}


@pytest.mark.parametrize("kind", KINDS)
def test_steps_match_the_python_path(vocab, monkeypatch, kind):
    model = model_of(kind, vocab, monkeypatch)
    ours = scripted_steps(model, vocab, True, monkeypatch)
    with torch.inference_mode():  # the step's products really of the kind asked
        step = convs2s_layers.step_of(model.decoder, torch.empty(0), [])
    products = [step.step.fc1, step.step.fc3, *(layer.conv for layer in step.table)]
    assert all(bool(p.bf16) == (kind == "bf16") for p in products)
    assert all(bool(p.sums) == (kind == "int8") for p in products)
    theirs = scripted_steps(model, vocab, False, monkeypatch)
    for (logits, attn), (their_logits, their_attn) in zip(ours, theirs, strict=True):
        assert logits.shape == their_logits.shape
        assert torch.equal(logits.argmax(-1), their_logits.argmax(-1))
        tolerance = TOLERANCE[kind]
        torch.testing.assert_close(logits, their_logits, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(attn, their_attn, rtol=tolerance, atol=tolerance / 10)


def test_no_attention_asked_none_given(vocab, monkeypatch):
    model = build_convs2s(vocab, 1)
    for logits, attn in scripted_steps(model, vocab, True, monkeypatch, need_attn=False):
        assert attn is None and logits.shape[1] == 1


def counting(monkeypatch) -> list[int]:
    """The rows of every step the C call runs."""
    calls: list[int] = []
    call = convs2s_layers.ConvS2SStep.__call__

    def counted(self, decoder, x, *args, **kwargs):
        calls.append(x.size(0))
        return call(self, decoder, x, *args, **kwargs)

    monkeypatch.setattr(convs2s_layers.ConvS2SStep, "__call__", counted)
    return calls


def decode(vocab, sentences, model, monkeypatch, in_kernel: bool):
    calls = counting(monkeypatch)
    with monkeypatch.context() as patch:
        if not in_kernel:
            patch.setattr(convs2s_layers, "step_of", lambda *_: None)
        gen = SequenceGenerator([model], vocab, beam_size=4, nbest=2, max_len_b=20)
        batch = gen.generate([model], make_batch(vocab, 8, seed=3))
        streamed, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
        assert engine.refills > 0
    assert bool(calls) == in_kernel
    return [*batch, *streamed]


@pytest.mark.parametrize("kind", KINDS)
def test_searches_match_the_python_path(vocab, sentences, monkeypatch, kind):
    """Batched and streamed (rows of sentences at different steps, memory groups): the same
    hypotheses, scores within float rounding."""
    model = model_of(kind, vocab, monkeypatch)
    ours = decode(vocab, sentences, model, monkeypatch, in_kernel=True)
    theirs = decode(vocab, sentences, model, monkeypatch, in_kernel=False)
    for our_hypotheses, their_hypotheses in zip(ours, theirs, strict=True):
        for o, t in zip(our_hypotheses, their_hypotheses, strict=True):
            assert torch.equal(o["tokens"], t["tokens"])
            tolerance = 1e-4 if kind in ("float32", "shapes") else 1e-2
            torch.testing.assert_close(o["positional_scores"], t["positional_scores"],
                                       rtol=0, atol=tolerance)  # fmt: skip
            torch.testing.assert_close(o["attention"], t["attention"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_sentence_gets_the_same_bits_alone_and_batched(vocab, sentences, monkeypatch, kind):
    model = model_of(kind, vocab, monkeypatch)
    calls = counting(monkeypatch)
    gen = SequenceGenerator([model], vocab, beam_size=3, nbest=2, max_len_b=15)
    batched, _ = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
    alone, _ = stream(gen, sentences[:1], [0])
    alone_too, _ = stream(gen, sentences[5:6], [0])
    assert calls and max(calls) > 3
    assert_identical([batched[0], batched[5]], [alone[0], alone_too[0]])


def test_isa_off_keeps_the_python_path(vocab, kernels_for):
    kernels_for("off")
    model = build_convs2s(vocab, 1)
    with torch.inference_mode():
        assert convs2s_layers.step_of(model.decoder, torch.empty(0), []) is None


def test_a_weight_changed_in_place_is_taken_at_the_next_encoder_forward(vocab, monkeypatch):
    model = build_convs2s(vocab, 1)
    before = scripted_steps(model, vocab, True, monkeypatch)
    with torch.inference_mode():
        step = convs2s_layers.step_of(model.decoder, torch.empty(0), [])
    with torch.no_grad():
        model.decoder.convolutions[1].weight_g.mul_(2)  # bumps its version
    after = scripted_steps(model, vocab, True, monkeypatch)  # encodes first
    with torch.inference_mode():
        assert convs2s_layers.step_of(model.decoder, torch.empty(0), []) is not step
    theirs = scripted_steps(model, vocab, False, monkeypatch)
    assert not torch.equal(before[-1][0], after[-1][0])
    torch.testing.assert_close(after[-1][0], theirs[-1][0], rtol=1e-5, atol=1e-5)

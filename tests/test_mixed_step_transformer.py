"""fairseq's transformer in its variants, decoded with sentences at different steps in one
forward (beamplugin.models.mixed_step_transformer): fairseq's hypotheses and scores for a
batch, and for each sentence of a stream what it gets alone. A variant our path does not
reproduce decodes batch after batch, and the log says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from builders import ORDERS, alone, assert_same, build_transformer, make_batch, stream
from fairseq.optim.nag import NAG
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.kernels import (
    float_attention,
)
from beamplugin.models.mixed_step_transformer import MixedStepTransformer
from beamplugin.modules import self_attention_history

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]

VARIANTS = {
    "post-norm, sinusoidal": {},
    "pre-norm, learned positions, shared embeddings": dict(
        encoder_normalize_before=True, decoder_normalize_before=True,
        encoder_learned_pos=True, decoder_learned_pos=True, share_all_embeddings=True,
    ),
    "embedding layer norm, unscaled embeddings, shared decoder output": dict(
        layernorm_embedding=True, no_scale_embedding=True,
        share_decoder_input_output_embed=True, decoder_output_dim=16,
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_mixes_steps_with_fairseqs_results(vocab, sentences, variant):
    shared = any("share" in option for option in VARIANTS[variant])
    pair = [
        build_transformer(vocab, seed, eos_boost=1.0 if shared else 3.0, **VARIANTS[variant])
        for seed in (1, 2)
    ]
    # each sentence's own maximum length: they end at different steps, however sharp EOS is
    options = dict(beam_size=4, max_len_a=1.0, max_len_b=2)
    for models in ([pair[0]], pair):  # one model, an ensemble
        gen = SequenceGenerator(models, vocab, **options)
        assert all(isinstance(m, MixedStepTransformer) for m in gen.model.models)
        sample = make_batch(vocab, 8, seed=3)
        expected = FairseqGenerator(models, vocab, **options).generate(models, sample)
        assert_same(expected, gen.generate(models, sample))
        alone_results = [alone(gen, s) for s in sentences]
        out, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
        assert_same(alone_results, out)
        assert engine.refills > 0


@pytest.fixture
def torch_kernels_only(kernels_for):
    """Our kernels off (as without a C compiler): torch's, as on a GPU or in half precision."""
    kernels_for("off")


def test_torchs_operations_give_the_same_results(vocab, sentences, torch_kernels_only):
    """The decoder's attention and products without our kernels, as a GPU, half precisions and
    a machine without a C compiler run them."""
    model = build_transformer(vocab, 1, eos_boost=3.0)
    options = dict(beam_size=4, max_len_a=1.0, max_len_b=2)
    gen = SequenceGenerator([model], vocab, **options)
    with torch.no_grad():
        assert not float_attention.serves(torch.zeros(1, 8), 2, 4)
    sample = make_batch(vocab, 8, seed=3)
    expected = FairseqGenerator([model], vocab, **options).generate([model], sample)
    assert_same(expected, gen.generate([model], sample))
    out, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
    assert_same([alone(gen, s) for s in sentences], out)
    assert engine.refills > 0


@pytest.mark.parametrize("kernels", ["ours", "torch's"])
def test_the_histories_moves_keep_fairseqs_results_and_each_sentences_bits(
    vocab, sentences, monkeypatch, request, kernels
):
    """The self-attention history moves its live columns every other step here (every 32 in
    use), through reorders and rows joining."""
    if kernels == "torch's":
        request.getfixturevalue("torch_kernels_only")
    monkeypatch.setattr(self_attention_history, "MOVE_EVERY", 2)
    model = build_transformer(vocab, 1)
    options = dict(beam_size=4, max_len_b=20)
    gen = SequenceGenerator([model], vocab, **options)
    sample = make_batch(vocab, 8, seed=3)
    expected = FairseqGenerator([model], vocab, **options).generate([model], sample)
    assert_same(expected, gen.generate([model], sample))
    alone_results = [alone(gen, s) for s in sentences]
    out, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=4)
    assert engine.refills > 0
    for ours, theirs in zip(out, alone_results, strict=True):
        for o, t in zip(ours, theirs, strict=True):
            assert torch.equal(o["tokens"], t["tokens"])
            assert torch.equal(o["positional_scores"], t["positional_scores"])


def test_a_variant_not_reproduced_decodes_batch_after_batch_and_says_why(
    vocab, sentences, caplog
):
    model = build_transformer(vocab, 1, adaptive_softmax_cutoff="10", decoder_output_dim=16)
    gen = SequenceGenerator([model], vocab, beam_size=3, max_len_b=20)
    assert gen.model.why_not_mixed == "fairseq transformer with an adaptive softmax"
    with caplog.at_level("INFO", logger="beamplugin.engine.engine"):
        out, engine = stream(gen, sentences, ORDERS["as given"], max_sentences=4)
    assert "an adaptive softmax" in caplog.text
    assert engine.refills == 0
    assert_same([alone(gen, s) for s in sentences], out, check_attention=False)


def test_a_generator_kept_across_training_follows_the_weights(vocab):
    """fairseq's task builds its generator once and validates with it between updates, and
    fairseq's optimizers write through ``p.data`` (no version bump): the prepared weights must
    still follow a training step, a state dict load and parameters replaced."""
    model = build_transformer(vocab, 1)
    options = dict(beam_size=3, max_len_b=8)
    kept = SequenceGenerator([model], vocab, **options)
    sample = make_batch(vocab, 4, seed=5)

    def check() -> list:
        out = kept.generate([model], sample)
        assert_same(FairseqGenerator([model], vocab, **options).generate([model], sample), out)
        return out

    before = check()
    model.train()
    optimizer = NAG(model.parameters(), lr=0.01)  # writes through p.data
    targets = sample["net_input"]["src_tokens"]  # learn to copy the source
    logits, _ = model(**sample["net_input"], prev_output_tokens=targets)
    F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=vocab.pad()).backward()
    optimizer.step()
    model.eval()
    after = check()
    assert any(
        not torch.equal(a[0]["positional_scores"], b[0]["positional_scores"])
        for a, b in zip(after, before, strict=True)
    )
    model.load_state_dict(build_transformer(vocab, 2).state_dict())
    loaded = check()
    # parameters replaced, not written into: the old ones keep their versions and storage
    torch.nn.Module.load_state_dict(model, build_transformer(vocab, 3).state_dict(), assign=True)
    replaced = check()
    assert any(
        not torch.equal(a[0]["positional_scores"], b[0]["positional_scores"])
        for a, b in zip(replaced, loaded, strict=True)
    )


@pytest.mark.parametrize(
    "options", [dict(beam_size=4), dict(beam_size=5, nbest=3, len_penalty=0.5)], ids=str
)
def test_a_stream_gives_each_sentence_the_very_bits_it_gets_alone(vocab, sentences, options):
    """Not only within float rounding: widths in multiples of the vector lanes (sources,
    memory, self-attention history) and products that give a row the same bits whatever the
    rows beside it make each sentence's scores and attention bit-identical."""
    gen = SequenceGenerator([build_transformer(vocab, 1)], vocab, max_len_b=20, **options)
    expected = [alone(gen, s) for s in sentences]
    for order in ORDERS.values():
        out, engine = stream(gen, sentences, order, window=4, max_sentences=5)
        assert engine.refills > 0
        for ours, theirs in zip(out, expected, strict=True):
            assert len(ours) == len(theirs)
            for o, t in zip(ours, theirs, strict=True):
                assert torch.equal(o["tokens"], t["tokens"])
                assert torch.equal(o["positional_scores"], t["positional_scores"])
                width = t["attention"].size(0)
                assert torch.equal(o["attention"][-width:], t["attention"])


def test_the_normalization_is_fairseqs_and_a_model_of_its_own_keeps_its_method(vocab):
    model = build_transformer(vocab, 1)
    view = MixedStepTransformer(model)
    assert view.plain_softmax
    logits = torch.randn(3, 1, len(vocab)) * 4
    for log_probs in (True, False):
        assert torch.equal(
            view.get_normalized_probs((logits, None), log_probs),
            model.get_normalized_probs((logits, None), log_probs),
        )

    class Tempered(type(model)):  # a model with a normalization of its own
        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return super().get_normalized_probs((net_output[0] / 2, None), log_probs, sample)

    model.__class__ = Tempered
    tempered = MixedStepTransformer(model)
    assert not tempered.plain_softmax
    expected = F.log_softmax(logits / 2, dim=-1)
    assert torch.equal(tempered.get_normalized_probs((logits, None), True), expected)

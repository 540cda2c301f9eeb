"""fairseq's transformer in its variants, decoded with sentences at different steps in one
forward (beamplugin.models.mixed_step_transformer): fairseq's hypotheses and scores for a
batch, and for each sentence of a stream what it gets alone. A variant our path does not
reproduce decodes batch after batch, and the log says why."""

from __future__ import annotations

import pytest
from builders import ORDERS, alone, assert_same, build_transformer, make_batch, stream
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.models.mixed_step_transformer import MixedStepTransformer

pytestmark = pytest.mark.usefixtures("one_thread")

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

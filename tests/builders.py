"""Tiny random models, batches and comparisons that several test modules share.

The models are sharpened (scaled output layer, larger EOS logits) so that sentences of one batch
finish at different steps and the batch really shrinks during the search.
"""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
from fairseq import search
from fairseq.data import Dictionary
from fairseq.models.fconv import FConvModel
from fairseq.models.fconv import base_architecture as fconv_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import base_architecture as transformer_architecture

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.kernels import float_products, int8_products
from beamplugin.models.convs2s import ConvS2SModel
from beamplugin.modules import int8_weights
from beamplugin.streams import IteratorSource, run, sentence_request

VOCAB_WORDS = 24


def word_dictionary(words: int) -> Dictionary:
    """fairseq's four special symbols and ``words`` words w0, w1, ..."""
    d = Dictionary()
    for i in range(words):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    return d


class _Task:
    def __init__(self, d: Dictionary) -> None:
        self.source_dictionary = self.target_dictionary = d


def small_conv_args() -> argparse.Namespace:
    return argparse.Namespace(
        encoder_embed_dim=16,
        encoder_layers="[(16, 3)] * 2",
        decoder_embed_dim=16,
        decoder_layers="[(16, 3)] * 2",
        decoder_out_embed_dim=16,
        dropout=0.0,
        max_source_positions=1024,
        max_target_positions=1024,
    )


def build_fconv(d: Dictionary, seed: int) -> FConvModel:
    torch.manual_seed(seed)
    args = small_conv_args()
    fconv_architecture(args)
    model = FConvModel.build_model(args, _Task(d)).eval()
    with torch.no_grad():
        model.decoder.fc3.weight_g.mul_(10)  # fc3 is weight-normed: scale its gain
        model.decoder.fc3.bias[d.eos()] += 1.5
    return model


def build_convs2s(d: Dictionary, seed: int) -> ConvS2SModel:
    """Our convs2s with an fconv's weights. It reads the encoder output once per sentence, so
    our generator never copies it per beam (fairseq's generator still copies it)."""
    model = ConvS2SModel.build_model(small_conv_args(), _Task(d))
    model.load_state_dict(build_fconv(d, seed).state_dict(), strict=True)
    return model.eval()


def build_transformer(
    d: Dictionary, seed: int, eos_boost: float = 3.0, **options: object
) -> TransformerModel:
    """A small fairseq transformer; ``options`` are its arguments (pre-norm, learned
    positions, shared embeddings, ...). Its output layer is sharpened and EOS boosted, so that
    sentences end at different steps (with shared embeddings, a smaller boost does)."""
    torch.manual_seed(seed)
    args = argparse.Namespace(
        **options,
        encoder_embed_dim=16,
        encoder_ffn_embed_dim=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_layers=2,
        decoder_attention_heads=2,
        dropout=0.0,
        max_source_positions=1024,
        max_target_positions=1024,
    )
    transformer_architecture(args)
    model = TransformerModel.build_model(args, _Task(d)).eval()
    projection = model.decoder.output_projection
    if projection is not None:  # (an adaptive softmax has its own)
        with torch.no_grad():
            projection.weight.mul_(3)
            projection.weight[d.eos()] *= eos_boost
    return model


BUILDERS = {"fconv": build_fconv, "convs2s": build_convs2s, "transformer": build_transformer}


def make_batch(d: Dictionary, bsz: int, seed: int, lengths: tuple[int, int] = (3, 12)) -> dict:
    """Left-padded sources ending in EOS, as fairseq's translation task collates them."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1], (bsz,), generator=g)
    width = int(lens.max()) + 1
    src = torch.full((bsz, width), d.pad(), dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        words = torch.randint(d.nspecial, len(d), (n,), generator=g)
        src[i, width - n - 1 :] = torch.cat([words, torch.tensor([d.eos()])])
    return {"id": torch.arange(bsz), "net_input": {"src_tokens": src, "src_lengths": lens + 1}}


def count_rows(gen: SequenceGenerator) -> list[int]:
    """Record the number of decoder rows at every step of ``gen``'s searches."""
    rows: list[int] = []
    decode_step = gen.model.decode_step

    def recording(tokens, *args, **kwargs):
        rows.append(tokens.size(0))
        return decode_step(tokens, *args, **kwargs)

    gen.model.decode_step = recording
    return rows


def assert_same(ref: list, out: list, check_attention: bool = True) -> None:
    assert len(ref) == len(out)
    for sent, (ref_hypos, our_hypos) in enumerate(zip(ref, out, strict=True)):
        assert len(ref_hypos) == len(our_hypos), f"sentence {sent}"
        for rank, (r, o) in enumerate(zip(ref_hypos, our_hypos, strict=True)):
            where = f"sentence {sent} hypothesis {rank}"
            assert o["tokens"].tolist() == r["tokens"].tolist(), where
            assert float(o["score"]) == pytest.approx(float(r["score"]), abs=1e-4), where
            torch.testing.assert_close(
                o["positional_scores"], r["positional_scores"].cpu(), atol=1e-4, rtol=0
            )
            if check_attention:
                assert o["attention"].shape == r["attention"].shape, where
                torch.testing.assert_close(
                    o["attention"], r["attention"].cpu(), atol=1e-5, rtol=0
                )


def assert_identical(ref: list, out: list) -> None:
    """Each sentence's n-best bit for bit: tokens, score, positional scores and attention over
    the sentence's own source (``out`` may be left-padded wider)."""
    assert len(ref) == len(out)
    for sent, (ref_hypos, our_hypos) in enumerate(zip(ref, out, strict=True)):
        assert len(ref_hypos) == len(our_hypos), f"sentence {sent}"
        for rank, (r, o) in enumerate(zip(ref_hypos, our_hypos, strict=True)):
            where = f"sentence {sent} hypothesis {rank}"
            assert torch.equal(o["tokens"], r["tokens"]), where
            assert torch.equal(o["score"], r["score"]), where
            assert torch.equal(o["positional_scores"], r["positional_scores"]), where
            width = r["attention"].size(0)
            assert not o["attention"][:-width].any(), where
            assert torch.equal(o["attention"][-width:], r["attention"]), where


def fairseq_reference(lprobs: torch.Tensor, scores: torch.Tensor, beam: int, step: int):
    """fairseq's BeamSearch.step plus its choice of the next beam (first beam non-EOS)."""
    bsz, in_beam, vocab = lprobs.shape
    d = word_dictionary(vocab - 4)
    history = scores.new_zeros(bsz, beam, step)
    full = lprobs.new_full((bsz, beam, vocab), -math.inf)
    full[:, :in_beam] = lprobs
    if step > 0:
        history[:, :, step - 1] = scores
    cand_scores, cand_tokens, cand_beams = search.BeamSearch(d).step(step, full, history)
    eos = cand_tokens.eq(d.eos()) & cand_scores.ne(-math.inf)
    cands = cand_scores.size(1)
    rank = eos.long() * cands + torch.arange(cands)
    active = torch.topk(rank, k=beam, dim=1, largest=False).indices
    return cand_scores, cand_tokens, cand_beams, eos[:, :beam], active


# Continuous batching: the ``sentences`` fixture (conftest.py) has STREAM_SENTENCES sentences.
STREAM_SENTENCES = 14
ORDERS = {
    "as given": list(range(STREAM_SENTENCES)),
    "shuffled": random.Random(3).sample(range(STREAM_SENTENCES), STREAM_SENTENCES),
}


def one_sentence(sentence: torch.Tensor) -> dict:
    lengths = torch.tensor([len(sentence)])
    return {"net_input": {"src_tokens": sentence[None], "src_lengths": lengths}}


def alone(gen: SequenceGenerator, sentence: torch.Tensor, prefix: torch.Tensor | None = None):
    sample = one_sentence(sentence)
    prefix_tokens = None if prefix is None or not len(prefix) else prefix[None]
    return gen.generate(None, sample, prefix_tokens=prefix_tokens)[0]


def stream(gen, sentences, order, prefixes=None, window=None, **capacity):
    """Decode ``sentences`` arriving in ``order`` on one engine; results by sentence, and the
    engine (for its refill count, and ``block_steps``: steps that attended two width blocks).
    ``window``: requests the engine takes ahead (each window joins in width order), if not its
    default (all of these sentences)."""
    engine = DecodingEngine.of(gen, **capacity)
    if window:
        engine.scheduler.encode_ahead = window
    groups = engine.slots.attention_groups
    engine.block_steps = 0

    def counted() -> list[tuple[int, int]]:
        out = groups()
        engine.block_steps += len(out) - (engine.slots.one_row > 0) > 1
        return out

    engine.slots.attention_groups = counted
    requests = (
        sentence_request(i, sentences[i], None if prefixes is None or not len(prefixes[i])
                         else prefixes[i])
        for i in order
    )
    results: dict[int, list] = {}
    with torch.inference_mode():
        for finished in run(engine, IteratorSource(requests)):
            assert finished.error is None, finished.error
            assert finished.key not in results, "a sentence came back twice"
            results[finished.key] = finished.hypotheses
    assert sorted(results) == sorted(order), "a sentence was lost"
    return [results[i] for i in range(len(sentences))], engine


def cast_or_skip(model: torch.nn.Module, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model`` cast for ``--int8`` (every product, small as they are) or ``--bf16`` (products
    on bfloat16 weights, float32 rows), or the test skipped where this CPU has no such kernel."""
    if precision == "int8":
        if not int8_products.available():
            pytest.skip("no int8 kernel for this instruction set")
        monkeypatch.setattr(int8_weights, "INT8_MIN_WEIGHTS", 0)
    if precision == "bf16" and not float_products.bf16_weights_available():
        pytest.skip("no AVX512-BF16 here")
    assert cast_for_decoding([model], precision) == torch.float32

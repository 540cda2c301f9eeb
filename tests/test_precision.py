"""Decoding in bfloat16: the models' products multiply bfloat16 weights (float32 rows rounded
to bfloat16 on our AVX512-BF16 kernel; elsewhere the models cast to bfloat16), the search in
float32.

On sharp random models (the generator's tests' ones) bfloat16 decoding gives the float32
translation for most sentences, with scores within bfloat16's rounding; the search step reads
float32 log-probs and picks exactly what fairseq's search picks from them; continuous batching in
bfloat16 gives each sentence what it gets alone in bfloat16. Unsupported precisions are refused;
``--bf16`` decodes in float32 where it would be slower. int8 products: test_int8.py.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from builders import (
    BUILDERS,
    ORDERS,
    alone,
    assert_identical,
    assert_same,
    fairseq_reference,
    make_batch,
    stream,
)
from precision_bounds import MIN_SAME_SHARE, N_SENTENCES, SCORE_TOLERANCE

from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin import precision
from beamplugin.fairseq_plugin.precision import (
    cast_for_decoding,
    native_on_cpu,
    requested_precision,
)
from beamplugin.kernels import float_products, native_library
from beamplugin.search import beam_step

# vocab, one_thread and sentences: conftest.py's module-scoped fixtures
# Each test but one is marked exact (make test runs them again per instruction set):
# test_bf16_decodes_in_float32_where_its_trial_finds_it_slower unpins the set (its trial is
# of the best one), so those runs would only repeat it.
pytestmark = pytest.mark.usefixtures("one_thread")
# elsewhere --bf16 decodes in float32 (test_bf16_decodes_in_float32_on_a_cpu_without_it)
needs_bf16 = pytest.mark.skipif(
    not native_on_cpu(torch.bfloat16), reason="this CPU has no bfloat16 products"
)


def activations() -> torch.dtype:
    """What --bf16's models compute in with this process's kernels: float32 on bfloat16 weights
    where our kernel runs, else bfloat16."""
    return torch.float32 if float_products.bf16_weights_available() else torch.bfloat16


def in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    assert cast_for_decoding([model], "bf16") == activations()
    return model


@pytest.fixture(scope="module")
def convs2s(vocab):
    return BUILDERS["convs2s"](vocab, 1)


@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
@needs_bf16
@pytest.mark.exact
def test_bf16_translations_equal_float32_on_most_sentences(vocab, arch):
    model = BUILDERS[arch](vocab, 1)
    sample = make_batch(vocab, N_SENTENCES, seed=3)
    options = dict(beam_size=5, max_len_b=20)
    reference = SequenceGenerator([model], vocab, **options).generate(None, sample)
    half = in_bf16(model)
    assert next(half.parameters()).dtype == activations()
    out = SequenceGenerator([half], vocab, **options).generate(None, sample)
    same = [
        (r[0], o[0])
        for r, o in zip(reference, out, strict=True)
        if r[0]["tokens"].tolist() == o[0]["tokens"].tolist()
    ]
    assert len(same) >= MIN_SAME_SHARE * N_SENTENCES, f"{len(same)} of {N_SENTENCES} equal"
    gaps = [abs(float(r["score"]) - float(o["score"])) for r, o in same]
    assert 0 < max(gaps) < SCORE_TOLERANCE, max(gaps)  # > 0: it really ran in bfloat16
    for _, hypo in same:
        assert hypo["score"].dtype == hypo["positional_scores"].dtype == torch.float32


@needs_bf16
@pytest.mark.exact
def test_search_reads_float32_log_probs_and_picks_as_fairseq(vocab, convs2s):
    """The decoder's bfloat16 logits are widened before the log-softmax (so the search sees
    float32, with the many exact ties bfloat16 makes); the search step then picks from them
    exactly what fairseq's BeamSearch picks."""
    half = in_bf16(convs2s)
    gen = SequenceGenerator([half], vocab, beam_size=4, max_len_b=20)
    sample = make_batch(vocab, 6, seed=8)
    net_input = sample["net_input"]
    tokens = torch.full((6, 1), vocab.eos(), dtype=torch.long)
    with torch.inference_mode():
        encoder_outs = gen.model.encode(net_input)
        lprobs, _ = gen.model.decode_step(tokens, encoder_outs, [{}], temperature=1.0)
        logits, _ = half.decoder(tokens, encoder_out=encoder_outs[0], incremental_state={})
    assert logits.dtype == activations() and lprobs.dtype == torch.float32
    assert torch.equal(lprobs, F.log_softmax(logits[:, -1].float(), dim=-1))
    g = torch.Generator().manual_seed(4)
    for beam, step in [(1, 0), (4, 0), (4, 3), (3, 7)]:
        in_beam = 1 if step == 0 else beam
        rows = lprobs[torch.randint(0, 6, (5 * in_beam,), generator=g)]
        table = rows.view(5, in_beam, -1).clone()
        table[:, :, vocab.pad()] = -torch.inf  # as the generator's rules mask it
        scores = torch.zeros(5, in_beam) if step == 0 else -torch.rand(5, in_beam, generator=g)
        ours = beam_step(table, scores, beam_size=beam, eos=vocab.eos())
        cand_scores, cand_tokens, cand_beams, finalize, active = fairseq_reference(
            table, scores, beam, step
        )
        assert ours.cand_scores.dtype == torch.float32
        assert ours.cand_scores.tolist() == cand_scores.tolist()
        assert ours.cand_tokens.tolist() == cand_tokens.tolist()
        assert ours.cand_beams.tolist() == cand_beams.tolist()
        assert ours.finalize.tolist() == finalize.tolist()
        assert ours.alive_tokens.tolist() == cand_tokens.gather(1, active).tolist()


@needs_bf16
@pytest.mark.parametrize(
    "options",
    [dict(beam_size=4), dict(beam_size=3, stopping="exact", len_penalty=0.5),
     dict(beam_size=3, print_alignment="hard")],
    ids=str,
)  # fmt: skip
@pytest.mark.exact
def test_stream_in_bf16_equals_each_sentence_alone_in_bf16(vocab, convs2s, sentences, options):
    gen = SequenceGenerator([in_bf16(convs2s)], vocab, **{"max_len_b": 20, **options})
    expected = [alone(gen, s) for s in sentences]
    for order in ORDERS.values():
        out, engine = stream(gen, sentences, order, max_sentences=4)
        assert_same(expected, out)
        assert engine.refills > 0


@needs_bf16
@pytest.mark.exact
def test_cached_inference_weights_follow_the_cast(vocab, convs2s):
    """Folded weights are made again in the new precision, and a cast back to float32 decodes
    exactly as before."""
    model = copy.deepcopy(convs2s)
    sample = make_batch(vocab, 8, seed=5)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    before = gen.generate(None, sample)
    fc3 = model.decoder.fc3
    with torch.inference_mode():
        assert fc3.weight.dtype == torch.float32
        model.to(torch.bfloat16)
        assert fc3.weight.dtype == torch.bfloat16
        folded = torch._weight_norm(fc3.weight_v.float(), fc3.weight_g.float(), 0)
        assert torch.equal(fc3.weight, folded.bfloat16())  # one rounding, from float32
    gen.generate(None, sample)
    model.to(torch.float32)
    model.load_state_dict(convs2s.state_dict())
    assert_same(before, gen.generate(None, sample))


@pytest.mark.exact
def test_precision_flags_and_unsupported_combinations(convs2s):
    assert requested_precision(fp16=False, bf16=False) == "float32"
    assert requested_precision(fp16=False, bf16=True) == "bf16"
    with pytest.raises(ValueError, match="exclude each other"):
        requested_precision(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="precision must be one of"):
        cast_for_decoding([convs2s], "int4")
    # the tiny model's weights are all below INT8_MIN_WEIGHTS; fairseq's fconv has no int8 path
    for model in (convs2s, BUILDERS["fconv"](convs2s.decoder.dictionary, 1)):
        with pytest.raises(ValueError, match="--int8: these models have no weight for int8"):
            cast_for_decoding([model], "int8")
    assert not convs2s.decoder.fc3.int8_products
    model = copy.deepcopy(convs2s)
    if native_on_cpu(torch.float16):
        assert cast_for_decoding([model], "fp16") == torch.float16
    else:
        with pytest.raises(ValueError, match="--fp16 on this CPU: it has no float16"):
            cast_for_decoding([model], "fp16")
        assert next(model.parameters()).dtype == torch.float32  # refused before any cast


FALLBACK = "decoding in float32"


def _cast_and_decode(model, vocab, sample, caplog) -> tuple[torch.dtype, list, int]:
    """``model`` (a copy) cast for --bf16 and decoded: its dtype, hypotheses, and how many
    times the log said it decodes in float32."""
    model = copy.deepcopy(model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="beamplugin"):
        dtype = cast_for_decoding([model], "bf16")
        out = SequenceGenerator([model], vocab, beam_size=5, max_len_b=20).generate(None, sample)
    assert {p.dtype for p in model.parameters()} == {dtype}
    return dtype, out, sum(FALLBACK in r.getMessage() for r in caplog.records)


@needs_bf16
def test_bf16_decodes_in_float32_where_its_trial_finds_it_slower(vocab, kernels_for, tmp_path,
                                                                 monkeypatch, caplog):  # fmt: skip
    """The load-time trial of bfloat16 against float32 (kept on disk as our kernels' trials):
    where float32 won, --bf16 decodes with float32's bits and says so once; where bfloat16
    won, it decodes in bfloat16."""
    monkeypatch.setenv(native_library.CACHE, str(tmp_path))
    kernels_for("")  # not pinned: the trial is timed, then its verdict is set below
    model = BUILDERS["transformer"](vocab, 1)
    sample = make_batch(vocab, 12, seed=6)
    reference = SequenceGenerator([copy.deepcopy(model)], vocab, beam_size=5, max_len_b=20)
    expected = reference.generate(None, sample)
    _cast_and_decode(model, vocab, sample, caplog)
    (kept,) = tmp_path.glob(f"trials/*/{precision.BF16_TRIAL}-*.txt")
    for verdict, dtype, said in [("torch 1.500 1.400 1.600", torch.float32, 1),
                                 ("ours 0.700 0.600 0.800", activations(), 0)]:  # fmt: skip
        kept.write_text(verdict + "\n")
        native_library.forget()  # a later process: it reads the verdict, times nothing
        cast_dtype, out, fallbacks = _cast_and_decode(model, vocab, sample, caplog)
        assert (cast_dtype, fallbacks) == (dtype, said)
        if said:
            assert_identical(expected, out)
        else:
            assert not torch.equal(out[0][0]["positional_scores"],
                                   expected[0][0]["positional_scores"])  # fmt: skip


@pytest.mark.exact
def test_bf16_decodes_in_float32_on_a_cpu_without_it(vocab, convs2s, monkeypatch, caplog):
    """Without bfloat16 products torch would emulate them, slower than float32: --bf16 decodes
    in float32 (float32's bits), and the log says so once."""
    monkeypatch.setattr(precision, "native_on_cpu", lambda dtype: dtype == torch.float32)
    sample = make_batch(vocab, 12, seed=6)
    reference = SequenceGenerator([copy.deepcopy(convs2s)], vocab, beam_size=5, max_len_b=20)
    expected = reference.generate(None, sample)
    dtype, out, fallbacks = _cast_and_decode(convs2s, vocab, sample, caplog)
    assert (dtype, fallbacks) == (torch.float32, 1)
    assert "no bfloat16 products" in caplog.text
    assert_identical(expected, out)

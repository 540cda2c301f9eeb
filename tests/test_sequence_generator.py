"""beamplugin's SequenceGenerator against fairseq's, on tiny random fconv and transformer models.

The models are sharpened (scaled output layer, larger EOS logits) so that sentences of one batch
finish at different steps and the batch really shrinks during the search.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from builders import BUILDERS, VOCAB_WORDS, assert_same, build_fconv, count_rows, make_batch
from fairseq import search
from fairseq.data import Dictionary
from fairseq.sequence_generator import EnsembleModel, SequenceGeneratorWithAlignment
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.modules import MemoryPool
from beamplugin.modules.packed_weights import uses_packed_products

# the models are builders.py's; the fixtures vocab, models and one_thread conftest.py's
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]


def sub_batch(sample: dict, rows: list[int]) -> dict:
    """The given sentences alone, re-padded to their own width."""
    src = sample["net_input"]["src_tokens"][rows]
    lengths = sample["net_input"]["src_lengths"][rows]
    width = int(lengths.max())
    return {
        "id": sample["id"][rows],
        "net_input": {"src_tokens": src[:, src.size(1) - width :], "src_lengths": lengths},
    }


PARITY_CASES = [
    *[dict(beam_size=b) for b in range(1, 9)],
    dict(beam_size=5, len_penalty=0.3),
    dict(beam_size=5, len_penalty=2.0),
    dict(beam_size=4, min_len=6),
    dict(beam_size=4, max_len_b=5),
    dict(beam_size=4, max_len_a=1.5, max_len_b=2),
    dict(beam_size=5, unk_penalty=2.0),
    dict(beam_size=5, unk_penalty=-3.0),
    dict(beam_size=5, normalize_scores=False),
    dict(beam_size=3, temperature=0.5),
    dict(beam_size=3, max_len=9),
]


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("options", PARITY_CASES, ids=lambda o: str(o))
def test_equals_fairseq_and_shrinks(vocab, models, arch, options):
    model = models[arch][0]
    sample = make_batch(vocab, 8, seed=3)
    options = {"max_len_b": 20, **options}
    ref = FairseqGenerator([model], vocab, **options).generate([model], sample)
    gen = SequenceGenerator([model], vocab, **options)
    rows = count_rows(gen)
    out = gen.generate([model], sample)
    assert_same(ref, out)
    # convs2s and the transformer (read per sentence, beamplugin.models.mixed_step_transformer)
    # decode the first step on one row per sentence (its beams are all the same), fconv on beam
    # rows, as fairseq; then finished sentences leave: the batch never grows
    # (test_batch_shrinks checks it shrinks)
    assert rows[0] == 8 * (options["beam_size"] if arch == "fconv" else 1)
    assert rows[1:] == sorted(rows[1:], reverse=True) and rows[1] <= 8 * options["beam_size"]


@pytest.mark.parametrize("bsz", [1, 4, 7])
def test_fconv_with_beamable_mm_equals_fairseq(vocab, bsz):
    """fairseq-generate prepares fconv with BeamableMM, which reads the rows of a step as
    groups of beam rows per sentence: the first step must not be decoded on fewer rows."""
    model = build_fconv(vocab, 3)
    model.make_generation_fast_(beamable_mm_beam_size=4)
    sample = make_batch(vocab, bsz, seed=8)
    ref = FairseqGenerator([model], vocab, beam_size=4, max_len_b=20).generate([model], sample)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    rows = count_rows(gen)
    assert_same(ref, gen.generate([model], sample))
    assert rows[0] == 4 * bsz


@pytest.mark.parametrize("arch", ["convs2s", "fconv"])
def test_large_vocabulary_equals_fairseq_and_is_batch_invariant(arch):
    # 16k words x 5 beams x 16 sentences: the chunked top-k path of the search step and, in
    # convs2s, a large output projection on oneDNN
    big = Dictionary()
    for i in range(1 << 14):
        big.add_symbol(f"w{i}")
    big.finalize(padding_factor=1)
    model = BUILDERS[arch](big, 4)
    with torch.no_grad():
        model.decoder.fc3.bias[big.eos()] += 2.5
        # our oneDNN path (convs2s takes it; fconv always uses F.linear)
        assert uses_packed_products(torch.zeros(1, 16), model.decoder.fc3.weight)
    sample = make_batch(big, 16, seed=16)
    options = dict(beam_size=5, max_len_b=12)
    ref = FairseqGenerator([model], big, **options).generate([model], sample)
    gen = SequenceGenerator([model], big, **options)
    rows = count_rows(gen)
    together = gen.generate([model], sample)
    assert_same(ref, together)
    assert rows[-1] < rows[1]
    for sentences in ([0], [9, 3]):
        apart = gen.generate([model], sub_batch(sample, sentences))
        assert_same([together[i] for i in sentences], apart, check_attention=False)


def test_nan_log_probs_are_never_chosen_as_in_fairseq(vocab, models, monkeypatch):
    model = models["fconv"][0]
    sample = make_batch(vocab, 6, seed=17)

    def poison(lprobs: torch.Tensor) -> torch.Tensor:
        lprobs[:, 7] = math.nan  # a word that would otherwise be chosen often
        lprobs[::3, vocab.eos()] = math.nan
        return lprobs

    fairseq_forward = EnsembleModel.forward_decoder
    monkeypatch.setattr(
        EnsembleModel,
        "forward_decoder",
        lambda self, *a, **k: (poison(fairseq_forward(self, *a, **k)[0]), None),
    )
    ref = FairseqGenerator([model], vocab, beam_size=3, max_len_b=12).generate([model], sample)
    gen = SequenceGenerator([model], vocab, beam_size=3, max_len_b=12)
    decode_step = gen.model.decode_step
    gen.model.decode_step = lambda *a, **k: (poison(decode_step(*a, **k)[0]), None)
    out = gen.generate([model], sample)
    assert_same(ref, out)
    assert all(7 not in h["tokens"].tolist() for hs in out for h in hs)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_batch_shrinks_on_this_data(vocab, models, arch):
    gen = SequenceGenerator(models[arch][:1], vocab, beam_size=4, max_len_b=20)
    rows = count_rows(gen)
    gen.generate(models[arch][:1], make_batch(vocab, 8, seed=3))
    assert len(set(rows)) >= 3, rows


def test_fconv_encoder_output_follows_beams_and_shrinks(vocab, models, monkeypatch):
    """fconv needs a row per decoder row: expanded once after encoding, then shrunk."""
    model = models["fconv"][0]
    sizes: list[int] = []
    reorder = model.encoder.reorder_encoder_out

    def recording(encoder_out, new_order):
        sizes.append(len(new_order))
        return reorder(encoder_out, new_order)

    monkeypatch.setattr(model.encoder, "reorder_encoder_out", recording)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    gen.generate([model], make_batch(vocab, 8, seed=3))
    assert sizes[0] == 8 * 4 and len(sizes) >= 3
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
    assert all(size % 4 == 0 for size in sizes)


def test_convs2s_encoder_memory_moves_only_for_leaving_sentences(vocab, models, monkeypatch):
    """convs2s reads one encoder row per sentence, pooled: the encoder output is never copied
    per beam nor reordered whole; a leaving sentence's slot takes one of the last sentences."""
    model = models["convs2s"][0]
    moves: list[tuple[int, int]] = []  # (sentences kept, slots that changed)
    rearrange = MemoryPool.rearrange

    def recording(pool, order):
        moves.append((len(order), sum(slot != old for slot, old in enumerate(order))))
        return rearrange(pool, order)

    monkeypatch.setattr(MemoryPool, "rearrange", recording)
    monkeypatch.setattr(model.encoder, "reorder_encoder_out", None)  # never called
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    gen.generate([model], make_batch(vocab, 8, seed=3))
    kept = [8] + [k for k, _ in moves]
    assert len(moves) >= 2 and kept == sorted(kept, reverse=True)
    assert all(moved <= before - after for (after, moved), before in zip(moves, kept, strict=False))
    assert sum(moved for _, moved in moves) > 0


@pytest.mark.parametrize("arch", [*sorted(BUILDERS), "convs2s+fconv"])
def test_ensemble_equals_fairseq(vocab, models, arch):
    # convs2s+fconv: one model reads the encoder output per sentence, the other per row
    first, second = arch.split("+") if "+" in arch else (arch, arch)
    pair = [models[first][0], models[second][1]]
    sample = make_batch(vocab, 6, seed=4)
    ref = FairseqGenerator(pair, vocab, beam_size=4, max_len_b=20).generate(pair, sample)
    out = SequenceGenerator(pair, vocab, beam_size=4, max_len_b=20).generate(pair, sample)
    assert_same(ref, out)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_prefix_tokens_equal_fairseq(vocab, models, arch):
    model = models[arch][0]
    sample = make_batch(vocab, 6, seed=5)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab.nspecial, len(vocab), (6, 3), generator=g)
    prefix[1, 2] = vocab.pad()  # shorter prefix
    prefix[2, 1:] = vocab.pad()
    prefix[3, 2] = vocab.eos()  # a prefix that ends the sentence
    options = dict(beam_size=4, max_len_b=20)
    fs = FairseqGenerator([model], vocab, **options)
    ref = fs.generate([model], sample, prefix_tokens=prefix)
    out = SequenceGenerator([model], vocab, **options).generate(
        [model], sample, prefix_tokens=prefix
    )
    assert_same(ref, out)
    for sent in range(6):
        wanted = [t for t in prefix[sent].tolist() if t != vocab.pad()]
        assert out[sent][0]["tokens"].tolist()[: len(wanted)] == wanted


def test_match_source_len_equals_fairseq(vocab, models):
    model = models["fconv"][0]
    sample = make_batch(vocab, 6, seed=6)
    strategy = search.LengthConstrainedBeamSearch(vocab, 1, 0, 1, 0)
    options = dict(beam_size=4, match_source_len=True, search_strategy=strategy)
    ref = FairseqGenerator([model], vocab, **options).generate([model], sample)
    out = SequenceGenerator([model], vocab, **options).generate([model], sample)
    assert_same(ref, out)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_batch_invariance(vocab, models, arch):
    model = models[arch][0]
    sample = make_batch(vocab, 7, seed=7)
    gen = SequenceGenerator([model], vocab, beam_size=5, max_len_b=20)
    together = gen.generate([model], sample)
    for rows in ([0], [3], [6], [1, 4], [5, 2, 0]):
        apart = gen.generate([model], sub_batch(sample, rows))
        assert_same([together[i] for i in rows], apart, check_attention=False)


@torch.no_grad()
def rescore(models: list, sample: dict, sent: int, tokens: torch.Tensor, d, temperature=1.0):
    """Teacher-forced full forward of ``tokens`` for one sentence: per-token log-probs."""
    one = sub_batch(sample, [sent])["net_input"]
    prev = torch.cat([torch.tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
    probs = []
    for model in models:
        logits = model(one["src_tokens"], one["src_lengths"], prev)[0] / temperature
        probs.append(F.softmax(logits.float(), dim=-1)[0])
    mean = torch.stack(probs).mean(0)
    return mean.log().gather(1, tokens.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("n_models", [1, 2])
def test_positional_scores_equal_forced_decoding(vocab, models, arch, n_models):
    ensemble = models[arch][:n_models]
    sample = make_batch(vocab, 5, seed=8)
    out = SequenceGenerator(ensemble, vocab, beam_size=3, max_len_b=20, temperature=0.7).generate(
        ensemble, sample
    )
    for sent, hypos in enumerate(out):
        for hypo in hypos:
            expected = rescore(ensemble, sample, sent, hypo["tokens"], vocab, temperature=0.7)
            torch.testing.assert_close(hypo["positional_scores"], expected, atol=1e-4, rtol=1e-4)
            length = len(hypo["tokens"])
            assert float(hypo["score"]) == pytest.approx(float(expected.sum()) / length, abs=1e-4)


def repeated_ngrams(tokens: list[int], n: int) -> int:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_blocks_on_cpu(vocab, models, n):
    model = models["fconv"][0]
    sample = make_batch(vocab, 6, seed=9)
    options = dict(beam_size=4, max_len_b=20, min_len=10)
    free = SequenceGenerator([model], vocab, **options).generate([model], sample)
    blocked = SequenceGenerator([model], vocab, no_repeat_ngram_size=n, **options).generate(
        [model], sample
    )
    # without blocking the model does repeat itself, so the check below can fail
    assert sum(repeated_ngrams(h["tokens"].tolist(), n) for hs in free for h in hs) > 0
    for hypos in blocked:
        assert len(hypos) == 4
        for hypo in hypos:
            # with BOS in front, as the search sees the sequence (EOS ends it, never repeats)
            assert repeated_ngrams([vocab.eos(), *hypo["tokens"].tolist()[:-1]], n) == 0


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("len_penalty", [0.0, 1.0, 2.0])
def test_exact_stopping_never_worse(vocab, models, arch, len_penalty):
    model = models[arch][0]
    sample = make_batch(vocab, 8, seed=10)
    options = dict(beam_size=3, max_len_b=20, len_penalty=len_penalty)
    usual = SequenceGenerator([model], vocab, **options).generate([model], sample)
    exact = SequenceGenerator([model], vocab, stopping="exact", **options).generate([model], sample)
    for u, e in zip(usual, exact, strict=True):
        assert len(e) == 3
        assert float(e[0]["score"]) >= float(u[0]["score"]) - 1e-6
        assert [float(h["score"]) for h in e] == sorted(
            (float(h["score"]) for h in e), reverse=True
        )


def test_exact_stopping_finds_better_with_length_bonus(vocab, models):
    # len_penalty 2 rewards long outputs: fairseq stops at the first beam hypotheses, the exact
    # rule keeps going and must find something better for at least one sentence
    model = models["fconv"][0]
    sample = make_batch(vocab, 8, seed=10)
    options = dict(beam_size=3, max_len_b=20, len_penalty=2.0)
    usual = SequenceGenerator([model], vocab, **options).generate([model], sample)
    exact = SequenceGenerator([model], vocab, stopping="exact", **options).generate([model], sample)
    gains = [float(e[0]["score"]) - float(u[0]["score"]) for u, e in zip(usual, exact, strict=True)]
    assert max(gains) > 1e-4


def test_gnmt_length_penalty(vocab, models):
    model = models["transformer"][0]
    sample = make_batch(vocab, 6, seed=11)
    alpha = 0.8
    out = SequenceGenerator(
        [model], vocab, beam_size=4, max_len_b=20, len_penalty=alpha, length_penalty_style="gnmt"
    ).generate([model], sample)
    for hypos in out:
        for hypo in hypos:
            length = len(hypo["tokens"])
            expected = float(hypo["positional_scores"].sum()) / ((5 + length) / 6) ** alpha
            assert float(hypo["score"]) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("arch", ["convs2s", "fconv"])
def test_alignment_equals_fairseq(vocab, models, arch):
    model = models[arch][0]
    sample = make_batch(vocab, 5, seed=12)
    for kind in ("hard", "soft"):
        ref = SequenceGeneratorWithAlignment(
            [model], vocab, beam_size=3, max_len_b=20, print_alignment=kind
        ).generate([model], sample)
        out = SequenceGenerator(
            [model], vocab, beam_size=3, max_len_b=20, print_alignment=kind
        ).generate([model], sample)
        assert_same(ref, out)
        ours = [h["alignment"] for hs in out for h in hs]
        theirs = [h["alignment"] for hs in ref for h in hs]
        if kind == "hard":
            assert ours == theirs
        else:  # probabilities printed with 6 decimals: float rounding may move the last one
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(
                    torch.tensor([[float(p) for p in row] for row in a]),
                    torch.tensor([[float(p) for p in row] for row in b]),
                    atol=1.5e-6, rtol=0,
                )


@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
def test_without_attention_the_hypotheses_are_the_same_and_keep_none(
    vocab, models, arch, monkeypatch
):
    model = models[arch][0]
    sample = make_batch(vocab, 6, seed=15)
    kept = SequenceGenerator([model], vocab, beam_size=3, max_len_b=20).generate([model], sample)
    gen = SequenceGenerator([model], vocab, beam_size=3, max_len_b=20, attention=False)
    decoder = gen.model.models[0].decoder
    returned, forward = [], decoder.forward

    def spied(*args, **kwargs):  # the decoder is asked for no attention, and makes none
        out = forward(*args, **kwargs)
        returned.append(out[1]["attn"][0] if isinstance(out[1], dict) else out[1])
        return out

    monkeypatch.setattr(decoder, "forward", spied)
    out = gen.generate([model], sample)
    assert returned and all(attn is None for attn in returned)
    assert_same(kept, out, check_attention=False)
    for hypos, kept_hypos in zip(out, kept, strict=True):
        for hypo, kept_hypo in zip(hypos, kept_hypos, strict=True):
            assert torch.equal(hypo["positional_scores"], kept_hypo["positional_scores"])
            assert hypo["attention"].numel() == 0 < kept_hypo["attention"].numel()


def test_never_returns_an_empty_list(vocab, models):
    # Every word and unk is forbidden and EOS is masked until max length: all live hypotheses
    # die (-inf) and no EOS candidate is ever finite (fairseq's generator trips an assertion).
    model = models["fconv"][0]
    sample = make_batch(vocab, 3, seed=13)
    words = ["<s>"] + [f"w{i}" for i in range(VOCAB_WORDS)]
    out = SequenceGenerator(
        [model],
        vocab,
        beam_size=2,
        max_len_b=4,
        min_len=4,
        unk_penalty=math.inf,
        tokens_to_suppress=words,
    ).generate([model], sample)
    for hypos in out:
        assert len(hypos) == 2
        for hypo in hypos:
            assert hypo["tokens"][-1] == vocab.eos()
            assert len(hypo["tokens"]) == 5


def test_nbest_truncates(vocab, models):
    model = models["fconv"][0]
    sample = make_batch(vocab, 4, seed=14)
    full = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20).generate([model], sample)
    top2 = SequenceGenerator([model], vocab, beam_size=4, nbest=2, max_len_b=20).generate(
        [model], sample
    )
    for f, t in zip(full, top2, strict=True):
        assert [h["tokens"].tolist() for h in t] == [h["tokens"].tolist() for h in f[:2]]


@pytest.mark.parametrize(
    "options, option_name",
    [
        (dict(beam_size=0), "beam_size"),
        (dict(beam_size=2, nbest=3), "nbest"),
        (dict(min_len=30, max_len_b=20), "min_len"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(stopping="greedy"), "stopping"),
        (dict(length_penalty_style="wu"), "length_penalty_style"),
        (dict(print_alignment="fuzzy"), "print_alignment"),
        (dict(print_alignment="hard", attention=False), "print_alignment"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    ],
)
def test_bad_options_fail_in_constructor(vocab, models, options, option_name):
    with pytest.raises(ValueError, match=option_name):
        SequenceGenerator(models["fconv"][:1], vocab, **options)


def test_min_len_above_source_dependent_max_len_fails_before_work(vocab, models):
    gen = SequenceGenerator(models["fconv"][:1], vocab, min_len=10, max_len_a=1, max_len_b=0)
    rows = count_rows(gen)
    with pytest.raises(ValueError, match="min_len"):
        gen.generate(models["fconv"][:1], make_batch(vocab, 2, seed=0, lengths=(2, 4)))
    assert rows == []


def test_unsupported_search_strategy_is_refused(vocab, models):
    with pytest.raises(ValueError, match="Sampling"):
        SequenceGenerator(models["fconv"][:1], vocab, search_strategy=search.Sampling(vocab))


def test_forward_matches_generate(vocab, models):
    model = models["transformer"][0]
    sample = make_batch(vocab, 3, seed=15)
    gen = SequenceGenerator([model], vocab, beam_size=2, max_len_b=10)
    assert_same(gen.generate([model], sample), gen(sample))
    assert math.isfinite(float(gen(sample)[0][0]["score"]))


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_outputs_are_ordinary_tensors_and_the_model_still_learns(vocab, arch):
    """The search runs under torch.inference_mode. What it returns must be ordinary tensors
    (fairseq-generate divides the positional scores in place), and nothing it leaves in the model
    may break a later backward pass (fairseq-train decodes during validation, then trains on)."""
    model = BUILDERS[arch](vocab, 4)
    sample = make_batch(vocab, 3, seed=16)
    out = SequenceGenerator([model], vocab, beam_size=2, max_len_b=10).generate([model], sample)
    for hypo in (hypo for hypos in out for hypo in hypos):
        assert not any(hypo[key].is_inference() for key in ("tokens", "score", "attention"))
        before = hypo["positional_scores"].clone()
        hypo["positional_scores"].div_(math.log(2))
        torch.testing.assert_close(hypo["positional_scores"], before / math.log(2))
    src = sample["net_input"]["src_tokens"]
    for train in (False, True):  # gradients through the eval-mode model too
        model.train(train)
        model.zero_grad()
        logits = model(src, sample["net_input"]["src_lengths"], prev_output_tokens=src)[0]
        logits.logsumexp(-1).sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0

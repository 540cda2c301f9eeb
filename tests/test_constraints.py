"""Lexical constraints (beamplugin.search.constraints) against fairseq's
LexicallyConstrainedBeamSearch, on the tiny random models of builders.py: each constrained
sentence gets fairseq's hypotheses and scores (fairseq's generator decoding it alone), ordered
and unordered, beams 1 to 8; where fairseq's generator fails (its constraints not met within
the maximum length) that sentence alone gets an error. In one stream with unconstrained
sentences each gets bit for bit what it gets alone."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from builders import BUILDERS, assert_identical, assert_same, one_sentence
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from fairseq.token_generation_constraints import (
    OrderedConstraintState,
    UnorderedConstraintState,
    pack_constraints,
)

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.engine.choice import open_engine
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.modules import int8_weights
from beamplugin.search.constraint_states import ROOT, ConstraintStates
from beamplugin.streams import IteratorSource, run, sentence_request, translate

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]

# per sentence of the conftest's stream (1 to 15 words): none, one token, several tokens,
# several constraints (one repeating a token of another), a long one
CONSTRAINTS = [
    [[5, 6]], [], [[7], [8, 9, 10]], [[11]], [[12, 13, 14, 15]], [[4], [4, 5]], [],
    [[20, 21, 22]], [[9], [16], [25]],
]


def generator(model, vocab, representation: str, **options) -> SequenceGenerator:
    strategy = search.LexicallyConstrainedBeamSearch(vocab, representation)
    return SequenceGenerator([model], vocab, search_strategy=strategy, **options)


def fairseq_alone(model, vocab, representation, sentence, constraints, **options):
    """fairseq's generator on one sentence: its hypotheses, or the AssertionError it fails
    with when no hypothesis meets the constraints by the maximum length."""
    strategy = search.LexicallyConstrainedBeamSearch(vocab, representation)
    gen = FairseqGenerator([model], vocab, search_strategy=strategy, **options)
    packed = pack_constraints([[torch.tensor(c) for c in constraints]])
    try:
        return gen.generate([model], one_sentence(sentence), constraints=packed)[0]
    except AssertionError as failed:
        return failed


def streamed(gen, sentences, constraints, order, **capacity) -> dict:
    """Each sentence's Finished, the sentences arriving in ``order`` on one engine."""
    engine = DecodingEngine.of(gen, **capacity)
    requests = (sentence_request(i, sentences[i], None, constraints=constraints[i]) for i in order)
    with torch.inference_mode():
        results = {f.key: f for f in run(engine, IteratorSource(requests))}
    assert sorted(results) == sorted(order), "a sentence was lost"
    return results


@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
@pytest.mark.parametrize("representation", ["ordered", "unordered"])
@pytest.mark.parametrize("beam", range(1, 9))
def test_equals_fairseq_alone_and_batched(vocab, models, sentences, arch, representation, beam):
    options = dict(beam_size=beam, max_len_b=(4, 8, 20)[beam % 3])
    _equals_fairseq(vocab, models[arch][0], sentences, representation, CONSTRAINTS, options)


# where batched states could part from fairseq's objects: a token repeated in a constraint,
# constraints sharing a prefix, one a prefix of another, overlapping ones (unordered: each
# one's end starts the other), the same constraint twice, many one-token constraints
TRICKY = [
    [[5, 6, 5, 7]], [[5, 6], [5, 7]], [[5], [5, 6, 7]], [[6, 7], [7, 8]], [[9, 9, 9]],
    [[4], [4], [8, 4]], [[10, 11], [11, 10]], [[12], [13], [14], [15]], [[16, 17, 16]],
]


@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
@pytest.mark.parametrize("representation", ["ordered", "unordered"])
@pytest.mark.parametrize("beam", [1, 8])
def test_tricky_constraints_equal_fairseq(vocab, models, sentences, arch, representation, beam):
    options = dict(beam_size=beam, max_len_b=12)
    _equals_fairseq(vocab, models[arch][0], sentences, representation, TRICKY, options)


def _equals_fairseq(vocab, model, sentences, representation, constraints, options) -> None:
    """Each sentence with its constraints: fairseq's hypotheses and scores (or its failure), in a
    stream of four, and bit for bit what it gets alone."""
    count = len(constraints)
    gen = generator(model, vocab, representation, **options)
    order = list(reversed(range(count)))
    results = streamed(gen, sentences, constraints, order, max_sentences=4)
    failures = 0
    for i in range(count):
        ref = fairseq_alone(model, vocab, representation, sentences[i], constraints[i], **options)
        ours = results[i]
        if isinstance(ref, AssertionError):
            failures += 1
            assert ours.error is not None and "not all met" in str(ours.error), f"sentence {i}"
            continue
        assert ours.error is None, f"sentence {i}: {ours.error}"
        assert_same([ref], [ours.hypotheses])
        # alone = in a stream of four, constrained and not, bit for bit
        alone = gen.generate(None, one_sentence(sentences[i]),
                             constraints=pack_constraints([[torch.tensor(c)
                                                            for c in constraints[i]]]))  # fmt: skip
        assert_identical(alone, [ours.hypotheses])
        for hypothesis in ours.hypotheses:
            tokens = hypothesis["tokens"].tolist()
            assert all(_contains(tokens, c) for c in constraints[i]), f"sentence {i}"
    assert failures < count  # most sentences meet their constraints


@pytest.mark.parametrize("representation", ["ordered", "unordered"])
def test_states_are_fairseqs(representation):
    """Random walks of tokens through random constraints (repeats, shared prefixes, restarts):
    every state reached has fairseq's bank, finished and next tokens, and banks weigh what
    fairseq's sort weighs them."""
    rng = random.Random(representation)
    make = OrderedConstraintState if representation == "ordered" else UnorderedConstraintState
    for _ in range(300):
        constraints = [[rng.randint(4, 8) for _ in range(rng.randint(1, 4))]
                       for _ in range(rng.randint(1, 4))]  # fmt: skip
        theirs = make.create(pack_constraints([[torch.tensor(c) for c in constraints]])[0])
        states = ConstraintStates(constraints, representation)
        assert states.sort_tokens == len(theirs.tokens)
        ours = ROOT
        for _ in range(25):
            token = rng.randint(3, 10)
            theirs, ours = theirs.advance(token), states.advance(ours, token)
            assert states.bank[ours] == theirs.bank
            assert states.finished[ours] == theirs.finished
            expected = [int(t) for t in theirs.next_tokens()]
            if representation == "ordered":  # fairseq's order there is its tensors' addresses
                assert sorted(states.next_tokens[ours]) == sorted(expected)
            else:
                assert states.next_tokens[ours] == expected


@pytest.mark.parametrize(
    "arch, beam, max_len_b, failing, constraints",
    [("convs2s", 2, 5, 4, [[7], [8, 9, 10]]), ("transformer", 4, 20, 0, [[12, 13, 14, 15]])],
)
def test_constraints_not_met_fail_their_sentence_alone(
    vocab, models, sentences, arch, beam, max_len_b, failing, constraints
):
    """Where no hypothesis meets the constraints by the maximum length, fairseq's generator
    fails (its batch with it): that sentence gets an error, the others their hypotheses."""
    model = models[arch][0]
    options = dict(beam_size=beam, max_len_b=max_len_b)
    assert isinstance(
        fairseq_alone(model, vocab, "ordered", sentences[failing], constraints, **options),
        AssertionError,
    )
    gen = generator(model, vocab, "ordered", **options)
    others = [i for i in range(4) if i != failing]
    requested = {failing: constraints, **{i: [[5 + i]] for i in others}}
    results = streamed(gen, sentences, requested, sorted(requested))
    assert "not all met within the maximum output length" in str(results[failing].error)
    assert results[failing].hypotheses == []
    for i in others:
        ref = fairseq_alone(model, vocab, "ordered", sentences[i], requested[i], **options)
        assert_same([ref], [results[i].hypotheses])


def test_int8_stream_equals_each_sentence_alone(vocab, models, sentences, monkeypatch):
    """--int8 (every product of the tiny model in int8): constrained and unconstrained
    sentences in one stream, each bit for bit what it gets alone."""
    monkeypatch.setattr(int8_weights, "INT8_MIN_WEIGHTS", 0)
    model = copy.deepcopy(models["convs2s"][0])
    assert cast_for_decoding([model], "int8") == torch.float32
    gen = generator(model, vocab, "unordered", beam_size=4, max_len_b=12)
    count = len(CONSTRAINTS)
    results = streamed(gen, sentences, CONSTRAINTS, list(range(count)), max_sentences=3)
    float32 = generator(models["convs2s"][0], vocab, "unordered", beam_size=4, max_len_b=12)
    in_float32 = streamed(float32, sentences, CONSTRAINTS, list(range(count)))
    assert any(
        float(results[i].hypotheses[0]["score"]) != float(in_float32[i].hypotheses[0]["score"])
        for i in range(count)
    ), "int8 decoded exactly as float32: were its products run?"
    for i in range(count):
        alone = gen.generate(None, one_sentence(sentences[i]),
                             constraints=pack_constraints([[torch.tensor(c)
                                                            for c in CONSTRAINTS[i]]]))  # fmt: skip
        assert_identical(alone, [results[i].hypotheses])


def test_translate_takes_each_sentences_constraints_with_it(vocab, models, sentences):
    """The stream API: a sentence given with its constraints gets what it gets alone under
    them, one given without any what the plain search gives it, in one stream."""
    model = models["transformer"][0]
    gen = generator(model, vocab, "ordered", beam_size=3, max_len_b=12)
    count = 5
    given = [(sentences[i], CONSTRAINTS[i]) if i % 2 == 0 else sentences[i] for i in range(count)]
    results = dict(translate(gen, given, max_sentences=2, ordered=True))
    assert sorted(results) == list(range(count))
    plain = SequenceGenerator([model], vocab, beam_size=3, max_len_b=12)
    for i in range(count):
        if i % 2:
            alone = plain.generate(None, one_sentence(sentences[i]))
        else:
            packed = pack_constraints([[torch.tensor(c) for c in CONSTRAINTS[i]]])
            alone = gen.generate(None, one_sentence(sentences[i]), constraints=packed)
            for hypothesis in results[i]:
                assert all(_contains(hypothesis["tokens"].tolist(), c) for c in CONSTRAINTS[i])
        assert_identical(alone, [results[i]])


def _contains(tokens: list[int], constraint: list[int]) -> bool:
    n = len(constraint)
    return any(tokens[start : start + n] == constraint for start in range(len(tokens) - n + 1))


@pytest.mark.parametrize("arch", ["convs2s", "transformer"])
def test_all_constrained_stream_with_refills_equals_alone(vocab, models, sentences, arch):
    """Every sentence in flight constrained (the step runs no plain beam step) while slots
    refill, so that a sentence's first step shares a step with others' later ones: each gets
    bit for bit what it gets alone."""
    gen = generator(models[arch][0], vocab, "unordered", beam_size=4, max_len_a=1, max_len_b=3)
    constraints = [c or [[7]] for c in CONSTRAINTS]
    engine = DecodingEngine.of(gen, max_sentences=3)
    requests = (sentence_request(i, sentences[i], None, constraints=constraints[i])
                for i in range(len(constraints)))  # fmt: skip
    with torch.inference_mode():
        results = {f.key: f for f in run(engine, IteratorSource(requests))}
    assert engine.refills > 0, "no sentence joined mid-search"
    for i, own in enumerate(constraints):
        packed = pack_constraints([[torch.tensor(c) for c in own]])
        assert results[i].error is None, f"sentence {i}: {results[i].error}"
        alone = gen.generate(None, one_sentence(sentences[i]), constraints=packed)
        assert_identical(alone, [results[i].hypotheses])


def test_unconstrained_sentences_unchanged(vocab, models, sentences):
    """Sentences without constraints in a constrained stream get what the plain search gives."""
    model = models["transformer"][0]
    plain = SequenceGenerator([model], vocab, beam_size=4, max_len_b=10)
    gen = generator(model, vocab, "unordered", beam_size=4, max_len_b=10)
    constraints = [[[7, 8]] if i % 2 else None for i in range(len(sentences))]
    results = streamed(gen, sentences, constraints, range(len(sentences)), max_sentences=5)
    for i in range(0, len(sentences), 2):
        alone = plain.generate(None, one_sentence(sentences[i]))
        assert_identical(alone, [results[i].hypotheses])


@pytest.mark.parametrize(
    "bad, error",
    [
        ([[]], "empty constraint"),
        ([[5] * 11], "cannot fit"),
        ([[5, 99]], "outside the vocabulary"),
        ([[2]], "EOS"),
        ([[5, 1]], "padding"),
    ],
)
def test_bad_constraints_fail_their_sentence_alone(vocab, models, sentences, bad, error):
    model = models["convs2s"][0]
    gen = generator(model, vocab, "ordered", beam_size=3, max_len_b=10)
    constraints = [[[6]], bad, [[7, 8]]]
    results = streamed(gen, sentences[:3], constraints, range(3))
    assert error in str(results[1].error)
    for i in (0, 2):
        assert results[i].error is None
        alone = gen.generate(None, one_sentence(sentences[i]),
                             constraints=pack_constraints([[torch.tensor(c)
                                                            for c in constraints[i]]]))  # fmt: skip
        assert_identical(alone, [results[i].hypotheses])


def test_constraints_need_a_constrained_search(vocab, models, sentences):
    """As fairseq's generator: constraints without LexicallyConstrainedBeamSearch are refused
    (by generate, and by the engine for a stream's sentence)."""
    model = models["convs2s"][0]
    plain = SequenceGenerator([model], vocab, beam_size=2)
    with pytest.raises(NotImplementedError, match="constraints"):
        plain.generate(None, one_sentence(sentences[0]),
                       constraints=pack_constraints([[torch.tensor([5])]]))  # fmt: skip
    results = streamed(plain, sentences[:2], [[[5]], None], range(2))
    assert "not built for lexical constraints" in str(results[0].error)
    assert results[1].error is None


def test_constrained_requests_go_to_the_decoding_engine(vocab, models):
    gen = generator(models["transformer"][0], vocab, "ordered", beam_size=2, attention=False,
                    device_engine="on")  # fmt: skip
    assert type(open_engine(gen.model, gen.options)) is DecodingEngine


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_batch_with_prefixes_equals_fairseq(vocab, models, arch):
    """A batch through generate, forced prefixes and all, as fairseq's generator decodes it."""
    model = models[arch][0]
    g = torch.Generator().manual_seed(5)
    src = torch.randint(vocab.nspecial, len(vocab), (3, 6), generator=g)
    src[:, -1] = vocab.eos()
    sample = {"id": torch.arange(3), "net_input": {"src_tokens": src,
                                                   "src_lengths": torch.full((3,), 6)}}  # fmt: skip
    prefix = torch.tensor([[9], [10], [vocab.pad()]])
    packed = pack_constraints([[torch.tensor([5, 6])], [torch.tensor([7])], []])
    strategy = search.LexicallyConstrainedBeamSearch(vocab, "unordered")
    options = dict(beam_size=3, max_len_b=12, search_strategy=strategy)
    ref = FairseqGenerator([model], vocab, **options).generate(
        [model], sample, prefix_tokens=prefix, constraints=packed
    )
    ours = SequenceGenerator([model], vocab, **options).generate(
        [model], sample, prefix_tokens=prefix, constraints=packed
    )
    assert_same(ref, ours)

"""The exact stopping rule (``stopping="exact"``): a sentence stops once no continuation of its
live hypotheses can enter its n-best, and not later.

* The bound (beamplugin.search.stopping) equals the best normalised score over every length a
  live hypothesis can still end with, computed here length by length.
* Decoding with it gives what a search that never stops early gives (the same beam, every
  sentence to its maximum length), with and without an unk bonus, for negative, zero and
  positive length penalties, one batch at a time and with sentences joining mid-search.
* Each sentence stops at the first step at which that best score is no higher than the worst
  hypothesis it keeps.
* It takes no step after that: its steps, counted in the engine, end at the first step at which
  its n-best is final, found from a search that never stops early, not from the engine's n-best
  keeper or stopping rule (a keeper that reported its best score as its worst, or a looser
  bound, fails here).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from builders import assert_same, make_batch
from fairseq import utils

import beamplugin.engine.finalizer
from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.engine.finalizer import Finalizer
from beamplugin.search import length_normaliser
from beamplugin.search.nbest import NBest
from beamplugin.search.options import DecodingOptions
from beamplugin.search.stopping import best_possible
from beamplugin.streams import IteratorSource, run, sentence_request

LENGTH_PENALTIES = [-1.0, 0.0, 1.5]
UNK_PENALTIES = [0.0, -1.0]  # a negative penalty is a bonus: scores can rise

pytestmark = pytest.mark.usefixtures("one_thread")


def bound_length_by_length(
    best: torch.Tensor, steps: list[int], max_lens: list[int], options: DecodingOptions
) -> torch.Tensor:
    """The best score any continuation can reach: for each length it can end with, the best
    summed score it can have then (the best live one, plus the unk bonus of every token still
    to come), normalised; the largest over all those lengths. Float32, as the search computes."""
    bonus = max(0.0, -options.unk_penalty)
    bounds = []
    for score, step, max_len in zip(best.tolist(), steps, max_lens, strict=True):
        summed = torch.tensor(score, dtype=torch.float32) + bonus * (max_len - step)
        if step >= max_len:  # it ends now: no continuation
            bounds.append(torch.tensor(-math.inf))
            continue
        if not options.normalize_scores:
            bounds.append(summed)
            continue
        # after step t a hypothesis has t + 1 tokens; it ends with EOS at t + 2 .. max_len + 1
        ends = [
            summed / length_normaliser(length, options.len_penalty, options.length_penalty_style)
            for length in range(step + 2, max_len + 2)
        ]
        bounds.append(torch.stack(ends).max())
    return torch.stack(bounds)


@pytest.mark.parametrize("style", ["fairseq", "gnmt"])
@pytest.mark.parametrize("len_penalty", [-1.5, -0.5, 0.0, 0.5, 2.0])
@pytest.mark.parametrize("unk_penalty", [0.0, -2.0, 3.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_bound_is_the_best_over_every_length(style, len_penalty, unk_penalty, normalize):
    options = DecodingOptions(
        eos=2, pad=1, unk=3, max_len=200, beam_size=4, stopping="exact",
        len_penalty=len_penalty, length_penalty_style=style, unk_penalty=unk_penalty,
        normalize_scores=normalize,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    steps = torch.randint(0, 30, (64,), generator=g).tolist()
    max_lens = [t + int(d) for t, d in zip(steps, torch.randint(1, 25, (64,), generator=g),
                                          strict=True)]
    # below and above zero: a score above zero needs an unk bonus, but the bound must hold
    best = torch.randn(64, generator=g) * 8 - 2
    expected = bound_length_by_length(best, steps, max_lens, options)
    torch.testing.assert_close(best_possible(best, steps, max_lens, options), expected,
                               rtol=1e-6, atol=0)


def never_stopping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sentences end only at their maximum length: no bound ever allows stopping."""
    monkeypatch.setattr(
        beamplugin.engine.finalizer, "best_possible",
        lambda best, *args: torch.full_like(best, float("inf")),
    )  # fmt: skip


def decode(gen: SequenceGenerator, sample: dict, capacity: int | None) -> list:
    """The sample's sentences: a batch at a time (``capacity`` None), or one by one as a stream
    of at most ``capacity`` sentences in flight (refills asserted)."""
    if capacity is None:
        return gen.generate(None, sample)
    sentences = [
        utils.strip_pad(row, gen.pad) for row in sample["net_input"]["src_tokens"]
    ]
    engine = DecodingEngine.of(gen, max_sentences=capacity)
    requests = (sentence_request(i, tokens, None) for i, tokens in enumerate(sentences))
    results = {}
    with torch.inference_mode():
        for finished in run(engine, IteratorSource(requests)):
            results[finished.key] = finished.hypotheses
    assert engine.refills > 0
    return [results[i] for i in range(len(sentences))]


@pytest.mark.parametrize("capacity", [None, 3], ids=["static", "continuous"])
@pytest.mark.parametrize("unk_penalty", UNK_PENALTIES, ids=lambda p: f"unk{p}")
@pytest.mark.parametrize("len_penalty", LENGTH_PENALTIES, ids=lambda p: f"lenpen{p}")
def test_exact_stopping_equals_a_search_to_the_maximum_length(
    vocab, models, monkeypatch, capacity, unk_penalty, len_penalty
):
    model = models["convs2s"][0]
    sample = make_batch(vocab, 8, seed=21)
    gen = SequenceGenerator(
        [model], vocab, beam_size=3, max_len_a=1.0, max_len_b=2, stopping="exact",
        len_penalty=len_penalty, unk_penalty=unk_penalty,
    )  # fmt: skip
    exact = decode(gen, sample, capacity)
    with monkeypatch.context() as patch:
        never_stopping(patch)
        full = decode(gen, sample, capacity)
    assert_same(full, exact)


@pytest.mark.parametrize("capacity", [None, 3], ids=["static", "continuous"])
@pytest.mark.parametrize("unk_penalty", UNK_PENALTIES, ids=lambda p: f"unk{p}")
@pytest.mark.parametrize("len_penalty", LENGTH_PENALTIES, ids=lambda p: f"lenpen{p}")
def test_a_sentence_stops_as_soon_as_the_bound_allows(
    vocab, models, monkeypatch, capacity, unk_penalty, len_penalty
):
    """After every step, a sentence is done exactly when it is at its maximum length or the
    best score of any continuation (computed length by length) is no higher than its worst
    kept hypothesis; sentences that stop before their maximum length are seen."""
    model = models["convs2s"][0]
    gen = SequenceGenerator(
        [model], vocab, beam_size=3, max_len_a=1.0, max_len_b=2, stopping="exact",
        len_penalty=len_penalty, unk_penalty=unk_penalty,
    )  # fmt: skip
    seen: dict = {}
    status = Finalizer.status

    def recording(self, res, slots):  # what the step's decision is made from
        seen.update(
            sentences=list(slots.live),
            steps=[s.step for s in slots.live],
            best=res.alive_scores[:, 0].clone(),
        )
        return status(self, res, slots)

    monkeypatch.setattr(Finalizer, "status", recording)
    sample = make_batch(vocab, 9, seed=22)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    engine = DecodingEngine.of(gen, max_sentences=capacity)
    for i, tokens in enumerate(sentences):
        request = sentence_request(i, tokens, None)
        engine.check(request)
        engine.enqueue(request)
    early = 0
    with torch.inference_mode():
        while not engine.idle:
            engine.admit_waiting()
            done = {f.key for f in engine.step()}
            live = seen["sentences"]
            bounds = bound_length_by_length(
                seen["best"], seen["steps"], [s.max_len for s in live], gen.options
            )
            for sentence, step, bound in zip(live, seen["steps"], bounds.tolist(), strict=True):
                at_max = step >= sentence.max_len
                allowed = bound <= sentence.nbest.worst_score()
                assert (sentence.key in done) == (at_max or allowed), (sentence.key, step)
                early += sentence.key in done and not at_max
    # a length bonus (len_penalty > 0) keeps these sentences searching to their maximum length
    assert early > 0 or len_penalty > 0


class StepRecord(NamedTuple):
    """One step of one sentence, as the finalizer saw it: its step, its best live cumulative
    score after it, its maximum length, and the scores of the hypotheses that ended in it."""

    step: int
    best: float
    max_len: int
    ended: list[float]


def recorded_steps(
    gen: SequenceGenerator, sample: dict, capacity: int | None, monkeypatch: pytest.MonkeyPatch
) -> dict[int, list[StepRecord]]:
    """Every step each sentence of ``sample`` takes in the engine, and what ended in it."""
    records: dict[int, list[StepRecord]] = {}
    owners: dict[int, list[float]] = {}  # an n-best keeper's id: its sentence's step's ends
    status, add = Finalizer.status, NBest.add

    def recording_status(self, res, slots):
        best = res.alive_scores[:, 0].tolist()
        owners.clear()
        for sentence, score in zip(slots.live, best, strict=True):
            record = StepRecord(sentence.step, score, sentence.max_len, [])
            records.setdefault(sentence.key, []).append(record)
            owners[id(sentence.nbest)] = record.ended
        return status(self, res, slots)

    def recording_add(self, score, hypothesis):
        owners[id(self)].append(score)
        return add(self, score, hypothesis)

    sentences = [utils.strip_pad(row, gen.pad) for row in sample["net_input"]["src_tokens"]]
    engine = DecodingEngine.of(gen, max_sentences=capacity)
    for i, tokens in enumerate(sentences):
        request = sentence_request(i, tokens, None)
        engine.check(request)
        engine.enqueue(request)
    with monkeypatch.context() as patch, torch.inference_mode():
        patch.setattr(Finalizer, "status", recording_status)
        patch.setattr(NBest, "add", recording_add)
        while not engine.idle:
            engine.admit_waiting()
            engine.step()
    return records


def first_safe_step(records: list[StepRecord], beam: int, options: DecodingOptions) -> int:
    """The first step after which no continuation can enter the sentence's n-best: its
    ``beam`` best ended hypotheses so far are full and the worst of them scores at least the
    bound (computed length by length); or its maximum length."""
    ended: list[float] = []
    for record in records:
        ended.extend(record.ended)
        kept = sorted(ended, reverse=True)[:beam]
        worst = kept[-1] if len(kept) == beam else -math.inf
        bound = bound_length_by_length(
            torch.tensor([record.best]), [record.step], [record.max_len], options
        ).item()
        if record.step >= record.max_len or bound <= worst:
            return record.step
    raise AssertionError("the search went past every step it recorded")


@pytest.mark.parametrize("capacity", [None, 3], ids=["static", "continuous"])
@pytest.mark.parametrize("unk_penalty", UNK_PENALTIES, ids=lambda p: f"unk{p}")
@pytest.mark.parametrize("len_penalty", LENGTH_PENALTIES, ids=lambda p: f"lenpen{p}")
def test_exact_stopping_takes_no_step_after_the_n_best_is_final(
    vocab, models, monkeypatch, capacity, unk_penalty, len_penalty
):
    """Each sentence takes exactly the steps up to the first one at which its n-best is final,
    counted in the engine; that step is found from a search that never stops early (the same
    beam), from every hypothesis that ended in it up to then and the bound, not from the
    engine's n-best keeper or its stopping rule. Some sentences stop before their maximum
    length (but with a length bonus)."""
    model = models["convs2s"][0]
    beam = 3
    gen = SequenceGenerator(
        [model], vocab, beam_size=beam, max_len_a=1.0, max_len_b=2, stopping="exact",
        len_penalty=len_penalty, unk_penalty=unk_penalty,
    )  # fmt: skip
    sample = make_batch(vocab, 9, seed=23)
    with monkeypatch.context() as patch:
        never_stopping(patch)
        full = recorded_steps(gen, sample, capacity, patch)
    taken = recorded_steps(gen, sample, capacity, monkeypatch)
    final = {key: first_safe_step(records, beam, gen.options) for key, records in full.items()}
    assert {key: records[-1].step for key, records in taken.items()} == final
    early = [key for key, records in full.items() if final[key] < records[-1].max_len]
    assert early or len_penalty > 0

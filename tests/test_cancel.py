"""Cancelled sentences leave the engine: waiting ones at once, those in flight at the end of the
next step, their slots freed for others; none comes back, and every other sentence gets the
n-best it gets alone."""

from __future__ import annotations

import pytest
import torch
from builders import alone, assert_same

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.streams import sentence_request

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cancelled_sentences_leave_and_the_others_are_unchanged(vocab, models, sentences):
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=3, min_len=6, max_len_b=20)
    engine = DecodingEngine.of(gen, max_sentences=4)
    for i, tokens in enumerate(sentences):
        request = sentence_request(i, tokens, None)
        engine.check(request)
        engine.enqueue(request)
    results: dict[int, list] = {}
    with torch.inference_mode():
        engine.admit_waiting()
        in_flight = [s.key for s in engine.live]
        results.update((f.key, f.hypotheses) for f in engine.step())
        waiting = [w.request.keys[0] for w in engine.waiting]
        cancelled = {in_flight[0], in_flight[2], waiting[1]}
        engine.cancel(cancelled)
        assert waiting[1] not in [w.request.keys[0] for w in engine.waiting]
        live_before = len(engine.live)
        results.update((f.key, f.hypotheses) for f in engine.step())
        # both cancelled sentences left with this step (min_len: nothing finished yet)
        assert len(engine.live) == live_before - 2
        while not engine.idle:
            engine.admit_waiting()
            results.update((f.key, f.hypotheses) for f in engine.step())
    assert engine.cancelled == 3
    kept = [i for i in range(len(sentences)) if i not in cancelled]
    assert sorted(results) == kept
    assert engine.refills > 0
    assert_same([alone(gen, sentences[i]) for i in kept], [results[i] for i in kept])

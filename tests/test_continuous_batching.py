"""Continuous batching: sentences admitted into freed capacity mid-search get the very n-best
lists (tokens, scores, positional scores, attention: the same bits) as when each is decoded
alone, whatever the capacity and the arrival order; nothing is lost or duplicated.

The models are the sharpened random ones of the generator's tests, and sentences have very
different lengths, so they finish at very different steps and slots really refill (asserted).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import random
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from builders import (
    ORDERS,
    VOCAB_WORDS,
    alone,
    assert_identical,
    assert_same,
    build_convs2s,
    build_transformer,
    one_sentence,
    stream,
)
from fairseq import search
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.engine.scheduler import (
    ENCODE_GROUP,
    ENCODER_FORWARD_TOKENS,
    MAX_ADMISSION_DELAY,
    Waiting,
    similar_widths,
)
from beamplugin.engine.slots import arrangement
from beamplugin.streams import (
    QueueFull,
    StreamClosed,
    StreamFailed,
    TranslationStream,
    sentence_request,
    translate,
)

# vocab, models, one_thread and sentences: conftest.py's module-scoped fixtures
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]


@pytest.fixture(scope="module")
def prefixes(vocab, sentences) -> list[torch.Tensor]:
    """Forced first tokens: none, short, padded (free choice) and ending the sentence."""
    g = torch.Generator().manual_seed(12)
    out = []
    for i in range(len(sentences)):
        prefix = torch.randint(vocab.nspecial, len(vocab), (i % 4,), generator=g)
        if i % 4 == 3 and i % 8 != 3:
            prefix[1] = vocab.pad()
        if i % 4 == 2 and i % 8 != 2:
            prefix[-1] = vocab.eos()
        out.append(prefix)
    return out


# Requests taken ahead: in windows of 4 the arrival order decides who shares steps (and
# sentences of very different widths do); all at once, they join narrowest first.
WINDOWS = {"windows of 4": 4, "one window": None}
# in flight: 3 or 5 sentences, or beam x 40 source tokens (3 to 8 of these sentences)
CAPACITIES = [dict(max_sentences=3), dict(max_sentences=5), dict(max_tokens=40)]

OPTIONS = [
    dict(beam_size=1),
    dict(beam_size=4),
    dict(beam_size=8),
    dict(beam_size=5, nbest=2),
    dict(beam_size=4, len_penalty=1.5, length_penalty_style="gnmt"),
    dict(beam_size=3, stopping="exact", len_penalty=0.5),
    dict(beam_size=4, min_len=5),
    dict(beam_size=4, max_len_a=1.0, max_len_b=2),
    dict(beam_size=4, unk_penalty=-2.0),
    dict(beam_size=3, temperature=0.6),
    dict(beam_size=4, no_repeat_ngram_size=1),
    dict(beam_size=4, no_repeat_ngram_size=2),
    dict(beam_size=3, match_source_len=True),
    dict(beam_size=3, print_alignment="hard"),
]


# the models that mix steps: beamplugin's convs2s, fairseq's transformer (on our decoding path)
MIXING = ["convs2s", "transformer"]


@pytest.mark.parametrize("arch", MIXING)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_stream_equals_each_sentence_alone(vocab, models, sentences, options, arch):
    model = models[arch][0]
    gen = SequenceGenerator([model], vocab, **{"max_len_b": 20, **options})
    expected = [alone(gen, s) for s in sentences]
    runs = [*itertools.product(ORDERS, ["windows of 4"]), ("shuffled", "one window")]
    for (order_name, window_name), capacity in itertools.product(runs, CAPACITIES):
        if "max_tokens" in capacity:
            capacity = dict(max_tokens=capacity["max_tokens"] * gen.beam_size)
        out, engine = stream(gen, sentences, ORDERS[order_name], window=WINDOWS[window_name],
                             **capacity)
        context = (order_name, window_name, capacity)
        assert_identical(expected, out)
        assert engine.refills > 0, context
        if window_name == "windows of 4":
            assert engine.block_steps > 0, context
        if options.get("print_alignment"):
            assert [[h["alignment"] for h in hs] for hs in out] == [
                [h["alignment"] for h in hs] for hs in expected
            ]


@pytest.mark.parametrize("arch", MIXING)
def test_narrow_attention_keeps_its_bits_across_the_widths_where_torch_changes_kernel(vocab, arch):
    """The test models attend with narrow vectors (the transformer's heads 8 wide, convs2s's
    keys 16): torch computes a product of one query row over fewer than 50 (25) positions in its
    own loop, over more in BLAS, and the two round differently. Sources of up to 40 words and
    outputs of up to 100 tokens cross these widths, alone and beside one another: each sentence
    still gets the bits it gets alone (the transformer's did not while its reads could be
    narrower than least_width)."""
    model = build_transformer(vocab, 1, eos_boost=0.0) if arch == "transformer" else (
        build_convs2s(vocab, 1))
    g = torch.Generator().manual_seed(5)
    sources = [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (n,), generator=g),
                   torch.tensor([vocab.eos()])])
        for n in (12, 40, 3, 20, 13, 25, 2, 33, 6, 18)
    ]
    gen = SequenceGenerator([model], vocab, beam_size=2, max_len_a=2.5, max_len_b=2)
    expected = [alone(gen, s) for s in sources]
    order = random.Random(3).sample(range(len(sources)), len(sources))
    out, engine = stream(gen, sources, order, window=4, max_sentences=4)
    assert_identical(expected, out)
    assert engine.refills > 0


@pytest.mark.parametrize("arch", MIXING)
def test_stream_with_prefixes_equals_each_sentence_alone(vocab, models, sentences, prefixes, arch):
    model = models[arch][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s, p) for s, p in zip(sentences, prefixes, strict=True)]
    for order in ORDERS.values():
        out, engine = stream(gen, sentences, order, prefixes, window=4, max_sentences=4)
        assert_identical(expected, out)
        assert engine.refills > 0
    for hypos, prefix in zip(out, prefixes, strict=True):
        tokens = hypos[0]["tokens"].tolist()
        for position, forced in enumerate(prefix.tolist()):
            if forced != vocab.pad():  # pad: free choice
                assert tokens[position] == forced
            if forced == vocab.eos():
                assert len(tokens) == position + 1


@pytest.mark.parametrize("arch", MIXING)
def test_stream_of_an_ensemble_with_length_constraints(vocab, models, sentences, arch):
    pair = models[arch]
    strategy = search.LengthConstrainedBeamSearch(vocab, 0.5, 1, 1.5, 2)
    gen = SequenceGenerator(pair, vocab, beam_size=4, max_len_b=20, search_strategy=strategy)
    expected = [alone(gen, s) for s in sentences]
    out, engine = stream(gen, sentences, ORDERS["shuffled"], max_sentences=4)
    assert_identical(expected, out)
    assert engine.refills > 0


@pytest.mark.parametrize("arch", MIXING)
def test_stream_equals_fairseq_with_default_options(vocab, models, sentences, arch):
    model = models[arch][0]
    options = dict(beam_size=5, max_len_b=20)
    fairseq = FairseqGenerator([model], vocab, **options)
    expected = [fairseq.generate([model], one_sentence(s))[0] for s in sentences]
    out, engine = stream(SequenceGenerator([model], vocab, **options), sentences,
                         ORDERS["shuffled"], max_sentences=4)
    assert_same(expected, out)
    assert engine.refills > 0


@pytest.mark.parametrize("ensemble", [["fconv"], ["transformer", "fconv"]], ids=str)
def test_models_that_cannot_mix_steps_decode_batch_after_batch(
    vocab, models, sentences, ensemble, caplog
):
    pair = [models[arch][0] for arch in ensemble]
    gen = SequenceGenerator(pair, vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    rows: list[int] = []
    decode_step = gen.model.decode_step
    gen.model.decode_step = lambda tokens, *a, **k: rows.append(len(tokens)) or decode_step(
        tokens, *a, **k
    )
    with caplog.at_level("INFO", logger="beamplugin.engine.engine"):
        out, engine = stream(gen, sentences, ORDERS["as given"], max_sentences=5)
    assert "FConvModel decodes one batch at a time" in caplog.text  # the log says why
    assert_same(expected, out, check_attention=False)  # a batch's attention spans its width
    assert engine.refills == 0
    # three batches of 5, 5 and 4 sentences, each starting on beam rows per sentence
    assert rows.count(5 * 4) >= 2 and rows.count(4 * 4) >= 1
    assert rows[0] == 5 * 4


def test_translate_yields_every_sentence_once_in_either_order(vocab, models, sentences):
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=3, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    too_long = torch.full((1100,), vocab.index("w1"))  # the model takes 1024 positions
    inputs = [*sentences[:5], too_long, *sentences[5:]]
    completed = list(translate(gen, inputs, max_sentences=4))
    assert sorted(i for i, _ in completed) == list(range(len(inputs)))
    assert [i for i, _ in completed] != list(range(len(inputs)))  # finished out of order
    ordered = list(translate(gen, inputs, max_sentences=4, ordered=True))
    assert [i for i, _ in ordered] == list(range(len(inputs)))
    results = dict(ordered)
    error = results.pop(5)
    limit = model.encoder.max_positions()
    assert isinstance(error, ValueError) and f"({limit} tokens" in str(error)
    assert_same(expected, [results[i] for i in sorted(results)])


def test_sentences_that_join_are_encoded_ahead_together(vocab, models):
    """Sentences waiting for a slot are encoded together, ahead of room for them (here all 12,
    of similar length, in one encoder forward at capacity 4), each once, and still get their
    n-best alone."""
    g = torch.Generator().manual_seed(5)
    sentences = [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (5 + i % 2,), generator=g),
                   torch.tensor([vocab.eos()])])
        for i in range(12)
    ]
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    forwards: list[int] = []
    encode = gen.model.encode
    gen.model.encode = lambda net_input: forwards.append(len(net_input["src_tokens"])) or encode(
        net_input
    )
    out, engine = stream(gen, sentences, list(range(12)), max_sentences=4)
    assert_same(expected, out)
    assert engine.refills > 0
    assert forwards == [12]


def test_a_window_is_grouped_at_once_and_each_group_encoded_when_its_first_joins(vocab, models):
    """The waiting sentences are grouped for the encoder together, but a group is encoded only
    when its first sentence joins: six short ones, then six long ones, at capacity 4 take a
    forward of the six short ones at once, and one of the six long ones steps later."""
    g = torch.Generator().manual_seed(6)
    sentences = [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (n,), generator=g),
                   torch.tensor([vocab.eos()])])
        for n in [3, 2, 3, 3, 2, 3] + [60] * 6
    ]
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    forwards: list[tuple[int, int]] = []  # (sentences, decoder steps taken before)
    steps: list[int] = []
    encode, decode_step = gen.model.encode, gen.model.decode_step
    gen.model.encode = lambda net_input: forwards.append(
        (len(net_input["src_tokens"]), len(steps))
    ) or encode(net_input)
    gen.model.decode_step = lambda *a: steps.append(1) or decode_step(*a)
    out, engine = stream(gen, sentences, list(range(12)), max_sentences=4)
    assert_same(expected, out)
    assert [count for count, _ in forwards] == [6, 6]
    assert forwards[0][1] == 0 and forwards[1][1] > 0


@pytest.mark.parametrize("arch", ["transformer", "convs2s"])
def test_a_groups_encoder_output_is_freed_once_written_without_the_collector(
    vocab, models, arch, monkeypatch
):
    """Once its sentences are written into the memory pools, a group's encoder output is freed
    at once: a group's list and its requests form a cycle, which had kept every output until
    the garbage collector ran. With the collector off, at every step no encoder output is alive
    but those the pools hold (a new batch's pool is a view of its output) and those of
    sentences still waiting."""
    g = torch.Generator().manual_seed(7)
    sentences = [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (n,), generator=g),
                   torch.tensor([vocab.eos()])])
        for n in [3, 2, 3, 3, 2, 3] + [30] * 6
    ]
    gen = SequenceGenerator([models[arch][0]], vocab, beam_size=4, max_len_b=12)
    outputs: list[list[weakref.ref]] = []  # per encoder forward, its tensors
    encode, decode_step = gen.model.encode, gen.model.decode_step

    def recorded(net_input):
        outs = encode(net_input)
        outputs.append([weakref.ref(t) for t in _tensors(outs)])
        return outs

    held_beyond: list[int] = []
    engines: list[DecodingEngine] = []
    of = DecodingEngine.of
    monkeypatch.setattr(
        DecodingEngine, "of", lambda *a, **k: engines.append(of(*a, **k)) or engines[-1]
    )

    def checked(*args):
        engine = engines[-1]
        pooled = {t.untyped_storage().data_ptr() for t in _tensors(engine.slots.memories)}
        waiting = {t.untyped_storage().data_ptr() for w in engine.scheduler.waiting
                   if w.encoded is not None for t in _tensors(w.encoded.outs)}  # fmt: skip
        alive = [r() for forward in outputs for r in forward if r() is not None]
        held_beyond.append(sum(
            t.untyped_storage().data_ptr() not in pooled | waiting for t in alive
        ))  # fmt: skip
        return decode_step(*args)

    gen.model.encode, gen.model.decode_step = recorded, checked
    gc.collect()
    gc.disable()
    try:
        out, engine = stream(gen, sentences, list(range(12)), max_sentences=4)
    finally:
        gc.enable()
    assert len(out) == 12 and engine.refills > 0 and len(outputs) == 2
    assert held_beyond and not any(held_beyond)


@pytest.mark.parametrize("arch", ["transformer", "convs2s"])
def test_once_the_last_sentence_leaves_the_engine_holds_nothing_of_its_batch(vocab, models, arch):
    """When no sentence is in flight, the engine lets go of the batch: its encoder outputs (the
    pools' memory), the decoder's incremental state, and for the transformer its history
    buffers, back in their pool for the next batch. Before, they stayed until the next batch's
    first step, beside its encoding (base size, 64 sentences: 87 MiB of the peak)."""
    g = torch.Generator().manual_seed(8)
    sentences = [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (n,), generator=g),
                   torch.tensor([vocab.eos()])])
        for n in [3, 5, 4, 9, 7, 8]
    ]
    model = models[arch][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=12)
    outputs: list[weakref.ref] = []
    encode = gen.model.encode

    def recorded(net_input):
        encoded = encode(net_input)
        outputs.extend(weakref.ref(t) for t in _tensors(encoded))
        return encoded

    gen.model.encode = recorded
    gc.collect()
    gc.disable()
    try:
        out, engine = stream(gen, sentences, list(range(6)), max_sentences=3)
        alive = [r() for r in outputs if r() is not None]
    finally:
        gc.enable()
    assert len(out) == 6 and outputs
    assert alive == [] and engine.runner.states == []
    assert all(pool.memory == {} for pool in engine.slots.memories)
    if arch == "transformer":
        history = gen.model.models[0].decoder.history
        assert history.buffers._free  # given back, to be lent again


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested dicts, lists, tuples and objects' attributes of ``value``."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif hasattr(value, "__dict__"):
        yield from _tensors(vars(value))


def test_sentences_arriving_one_by_one_wait_a_little_to_be_encoded_together(
    vocab, models, sentences
):
    """While others decode and more may come (a server), a sentence that would be encoded
    alone waits up to MAX_ADMISSION_DELAY steps for company; ENCODE_GROUP waiting sentences, an
    idle engine, or no more coming: in at once. Each still gets its n-best alone."""
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, min_len=12, max_len_b=30)
    engine = DecodingEngine.of(gen, max_sentences=16)
    forwards: list[int] = []
    encode = gen.model.encode
    gen.model.encode = lambda net_input: forwards.append(len(net_input["src_tokens"])) or encode(
        net_input
    )
    finished: dict[int, list] = {}

    def arrive(*indices: int, more_coming: bool = True) -> int:
        for i in indices:
            request = sentence_request(i, sentences[i], None)
            engine.check(request)
            engine.enqueue(request)
        engine.admit_waiting(more_coming)
        return len(engine.live)

    def step() -> None:
        finished.update((f.key, f.hypotheses) for f in engine.step())

    with torch.inference_mode():
        assert arrive(0) == 1  # the engine was idle
        assert arrive(1) == 1
        for waited in range(1, MAX_ADMISSION_DELAY + 1):
            step()
            assert arrive() == (2 if waited == MAX_ADMISSION_DELAY else 1)
        assert forwards == [1, 1]
        assert arrive(*range(2, 2 + ENCODE_GROUP)) == 2 + ENCODE_GROUP
        step()
        assert arrive(10, more_coming=False) == 3 + ENCODE_GROUP
        while engine.live:
            step()
    assert sum(forwards) == 11 and forwards[-1] == 1
    assert_same([alone(gen, sentences[i]) for i in range(11)], [finished[i] for i in range(11)])


def test_each_window_joins_in_width_order_after_the_windows_before(vocab, models):
    """The requests taken ahead join narrowest first; a request that comes later, however
    narrow, waits for those planned before it (a window overtakes no earlier one)."""
    gen = SequenceGenerator([models["convs2s"][0]], vocab, beam_size=2, max_len_b=6)
    engine = DecodingEngine.of(gen, max_sentences=2)
    joined: list[int] = []
    allocate = engine.slots.allocate
    engine.slots.allocate = lambda admitted: joined.extend(
        w.request.keys[0] for w in admitted
    ) or allocate(admitted)

    def arrive(key: int, words: int) -> None:
        request = sentence_request(key, torch.full((words + 1,), vocab.eos()), None)
        engine.check(request)
        engine.enqueue(request)

    with torch.inference_mode():
        for key, words in enumerate([9, 4, 7]):
            arrive(key, words)
        engine.admit_waiting()
        assert joined == [1, 2]
        arrive(3, 3)
        arrive(4, 1)
        while engine.live or engine.waiting:
            engine.step()
            engine.admit_waiting()
    assert joined == [1, 2, 0, 4, 3]


def test_sentences_stay_in_width_blocks_and_few_move():
    """Sentences with beam rows are kept grouped by width block, narrow first: those in their
    block's new range keep their slot, the others (and those after the sentences that left) fill
    its holes in their order. One block: the last ones fill the holes of those that left."""
    assert arrangement([0, None, 1, 0, None, 1, 0]) == [0, 3, 6, 2, 5]
    assert arrangement([1, 1, 0]) == [2, 1, 0]
    assert arrangement([0, None, 0, 0, None, 0]) == [0, 5, 2, 3]
    assert arrangement([0, 0, 1, 1]) == [0, 1, 2, 3]
    assert arrangement([None, None]) == []


def test_encoder_groups_cost_the_least(vocab):
    """Waiting sentences are encoded in the groups that cost least, a forward counting as
    ENCODER_FORWARD_TOKENS tokens more: checked against every split of the sorted widths into
    runs. The groups come narrowest first, each by width; sentences of one width keep their order
    of arrival."""

    def groups(widths: list[int]) -> list[list[int]]:  # arrival indices
        waiting = [
            Waiting(sentence_request(i, torch.full((w,), vocab.eos()), None), since=0)
            for i, w in enumerate(widths)
        ]
        return [[w.request.keys[0] for w in group] for group in similar_widths(waiting)]

    def cost(groups: list[list[int]]) -> int:
        return sum(ENCODER_FORWARD_TOKENS + len(g) * max(g) for g in groups)

    small = ENCODER_FORWARD_TOKENS // 2
    assert groups([small, 3]) == [[1, 0]]  # a second forward would cost more than the padding
    assert groups([3, ENCODER_FORWARD_TOKENS + 10]) == [[0], [1]]
    rng = random.Random(0)
    for _ in range(40):
        widths = [rng.randint(2, 40) for _ in range(rng.randint(1, 10))]
        got = groups(widths)
        flat = [i for g in got for i in g]
        assert flat == sorted(range(len(widths)), key=lambda i: (widths[i], i))
        distinct = sorted(set(widths))
        splits = (
            [distinct[a:b] for a, b in itertools.pairwise([0, *cuts, len(distinct)])]
            for n in range(len(distinct))
            for cuts in itertools.combinations(range(1, len(distinct)), n)
        )
        best = min(cost([[w for w in widths if w in run] for run in split]) for split in splits)
        assert cost([[widths[i] for i in g] for g in got]) == best


def test_a_vocabulary_under_two_beams_when_sentences_join(sentences):
    """A sentence at its first step decodes one row, which has fewer candidates than beam rows
    when the vocabulary has fewer than 2 x beam words: the joining sentences' steps are
    widened with dead candidates, and every sentence still gets its n-best alone."""
    tiny = Dictionary()
    for i in range(5):
        tiny.add_symbol(f"w{i}")
    tiny.finalize(padding_factor=1)  # 9 symbols: one row has 8 candidates, beam 5 asks 10
    model = build_convs2s(tiny, 3)
    words = [s.remainder(5) + tiny.nspecial for s in sentences]
    words = [torch.cat([w[:-1], torch.tensor([tiny.eos()])]) for w in words]
    gen = SequenceGenerator([model], tiny, beam_size=5, max_len_b=12)
    out, engine = stream(gen, words, list(range(len(words))), max_sentences=3)
    assert_same([alone(gen, w) for w in words], out)
    assert engine.refills > 0


def test_sentences_that_die_at_their_first_step_come_back_with_beam_hypotheses(
    vocab, models, sentences
):
    """Every word and unk forbidden and EOS masked until min_len: all hypotheses die at the
    first step, when each sentence has one row, and exact stopping ends them there; each still
    gets beam hypotheses (its one row with EOS), as when decoded alone."""
    words = ["<s>"] + [f"w{i}" for i in range(VOCAB_WORDS)]
    gen = SequenceGenerator(
        [models["convs2s"][0]], vocab, beam_size=3, max_len_b=4, min_len=4,
        unk_penalty=math.inf, tokens_to_suppress=words, stopping="exact",
    )
    out, _ = stream(gen, sentences, list(range(len(sentences))), max_sentences=5)
    assert_same([alone(gen, s) for s in sentences], out)
    for hypos in out:
        assert [h["tokens"].tolist() for h in hypos] == [[vocab.eos()]] * 3


def test_stream_ends_with_slots_half_full(vocab, models, sentences):
    """The last sentences are admitted while the engine still holds others; the stream ends
    with free slots: everything still comes back once."""
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    out, engine = stream(gen, sentences[:7], list(range(7)), max_sentences=5)
    assert_same([alone(gen, s) for s in sentences[:7]], out)
    assert engine.refills == 2 and not engine.live


def test_translation_stream_from_many_threads(vocab, models, sentences):
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    expected = [alone(gen, s) for s in sentences]
    futures: dict[int, object] = {}
    with TranslationStream(gen, max_sentences=3, max_queued=4) as translator:

        def client(first: int) -> None:
            for i in range(first, len(sentences), 3):
                futures[i] = translator.submit(sentences[i])

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # closing waited for every accepted sentence
    assert sorted(futures) == list(range(len(sentences)))
    assert all(f.done() for f in futures.values())
    assert_same(expected, [futures[i].result() for i in range(len(sentences))])
    assert translator.engine.refills > 0 and translator.completed == len(sentences)
    with pytest.raises(StreamClosed):
        translator.submit(sentences[0])


@contextlib.contextmanager
def decoder_held_at_first_step(gen: SequenceGenerator) -> Iterator[threading.Event]:
    """The model's first decoder step waits until the yielded event is set (10 s at most)."""
    started = threading.Event()
    release = threading.Event()
    decode_step = gen.model.decode_step

    def slow(*args, **kwargs):
        started.set()
        release.wait(10)
        return decode_step(*args, **kwargs)

    gen.model.decode_step = slow
    try:
        yield started
    finally:
        release.set()
        gen.model.decode_step = decode_step


def test_a_full_queue_refuses_instead_of_growing(vocab, models, sentences):
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    translator = TranslationStream(gen, max_sentences=1, max_queued=2)
    try:
        with decoder_held_at_first_step(gen) as started:
            first = translator.submit(sentences[0])
            started.wait(10)  # the decoder holds the first sentence; two may wait
            waiting = [translator.submit(sentences[i], block=False) for i in (1, 2)]
            with pytest.raises(QueueFull):
                translator.submit(sentences[3], block=False)
            with pytest.raises(QueueFull):
                translator.submit(sentences[3], timeout=0.05)
            assert translator.queued == 2
    finally:
        translator.close()
    assert_same([alone(gen, sentences[i]) for i in (0, 1, 2)],
                [f.result() for f in (first, *waiting)])


def test_sentences_submitted_together_are_queued_all_or_none(vocab, models, sentences):
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    translator = TranslationStream(gen, max_sentences=1, max_queued=3)
    try:
        with decoder_held_at_first_step(gen) as started:
            first = translator.submit_together([sentences[0]])
            started.wait(10)  # the decoder holds the first sentence; three may wait
            pair = translator.submit_together([sentences[1], sentences[2]])
            with pytest.raises(QueueFull):
                translator.submit_together([sentences[3], sentences[4]])
            assert translator.queued == 2  # nothing of the refused pair got in
            last = translator.submit_together([sentences[4]])
            with pytest.raises(ValueError, match="more than the queue holds"):
                translator.submit_together(sentences[:4])
    finally:
        translator.close()
    with pytest.raises(StreamClosed):
        translator.submit_together([sentences[0]])
    futures = first + pair + last
    assert_same([alone(gen, sentences[i]) for i in (0, 1, 2, 4)], [f.result() for f in futures])


# the decoder thread ends with the model's error, as it should: its traceback is the log
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_model_fails_every_accepted_sentence_and_refuses_later_ones(
    vocab, models, sentences
):
    """When the model raises mid-stream, no caller waits forever: sentences in flight, taken
    ahead and queued get the error, and the stream refuses new ones (StreamFailed)."""
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    translator = TranslationStream(gen, max_sentences=2, max_queued=8)
    calls = []
    decode_step = gen.model.decode_step

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the accelerator is gone")
        return decode_step(*args, **kwargs)

    gen.model.decode_step = failing
    try:
        futures = translator.submit_together(sentences[:8])  # in the queue before any step
        for future in futures:
            with pytest.raises(RuntimeError, match="the accelerator is gone"):
                future.result(timeout=30)
        with pytest.raises(StreamFailed, match="the decoder failed"):
            translator.submit(sentences[0])
        assert isinstance(translator.failure, RuntimeError)
    finally:
        translator.close(timeout=10)

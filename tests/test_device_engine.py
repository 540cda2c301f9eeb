"""The device engine on the CPU, the GPU's code path but the capture itself: fixed rows, buckets,
the whole step on the device and the host a step behind. Its hypotheses and scores are those of
the other engine and of fairseq's generator; each sentence gets the same bits alone, in a static
batch and in a stream where sentences join and leave (other buckets, moved slots); its step
makes no call that would wait for a GPU or could not be captured."""

from __future__ import annotations

import pytest
import torch
from builders import BUILDERS, assert_identical, assert_same, make_batch, word_dictionary
from fairseq import utils
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from torch.utils._python_dispatch import TorchDispatchMode

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine, DeviceEngine, open_engine
from beamplugin.engine.fixed_rows import Bucket, FixedRows
from beamplugin.streams import IteratorSource, run, sentence_request


def _generator(model, vocab, **options) -> SequenceGenerator:
    options = {"max_len_b": 20, "attention": False, "device_engine": "on", **options}
    return SequenceGenerator([model], vocab, **options)


@pytest.mark.parametrize(
    "options",
    [dict(beam_size=1), dict(beam_size=5), dict(beam_size=4, min_len=6),
     dict(beam_size=3, unk_penalty=-0.5, len_penalty=0.6),
     dict(beam_size=4, length_penalty_style="gnmt", len_penalty=1.2),
     dict(beam_size=2, normalize_scores=False, nbest=2, temperature=0.7),
     dict(beam_size=4, no_repeat_ngram_size=1), dict(beam_size=5, no_repeat_ngram_size=2),
     dict(beam_size=3, no_repeat_ngram_size=3)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("shape", [{}, {"encoder_normalize_before": True,
                                        "decoder_normalize_before": True,
                                        "decoder_learned_pos": True}, "convs2s"],
                         ids=["post", "pre", "convs2s"])  # fmt: skip
def test_equals_the_other_engine_and_fairseq(vocab, shape, options):
    if shape == "convs2s":
        model = BUILDERS["convs2s"](vocab, 1)
    else:
        model = BUILDERS["transformer"](vocab, 1, **shape)
    sample = make_batch(vocab, 8, seed=3)
    ours = _generator(model, vocab, **options)
    other = _generator(model, vocab, device_engine="off", **options)
    assert isinstance(open_engine(ours.model, ours.options), DeviceEngine)
    out = ours.generate([model], sample)
    assert_same(other.generate([model], sample), out, check_attention=False)
    fairseq_options = {k: v for k, v in options.items() if k not in ("length_penalty_style",
                                                                      "nbest")}  # fmt: skip
    # fairseq's CPU n-gram blocker blocks nothing (see beam_step.block_repeated_ngrams): the
    # other engine blocks as fairseq's CUDA kernel does, and is the reference there
    if "length_penalty_style" not in options and "no_repeat_ngram_size" not in options:
        ref = FairseqGenerator([model], vocab, max_len_b=20, **fairseq_options)
        reference = ref.generate([model], sample)
        if "nbest" in options:
            reference = [r[: options["nbest"]] for r in reference]
        assert_same(reference, out, check_attention=False)


def _stream(generator: SequenceGenerator, sentences: list[torch.Tensor], capacity: int
            ) -> tuple[dict, DeviceEngine]:  # fmt: skip
    engine = open_engine(generator.model, generator.options, max_sentences=capacity)
    assert isinstance(engine, DeviceEngine)
    requests = [sentence_request(i, s, None) for i, s in enumerate(sentences)]
    with torch.inference_mode():
        return {f.key: f.hypotheses for f in run(engine, IteratorSource(requests))}, engine


@pytest.mark.exact
@pytest.mark.parametrize(("arch", "precision"), [("transformer", torch.float32),
                                                 ("transformer", torch.bfloat16),
                                                 ("convs2s", torch.float32)], ids=str)
def test_each_sentence_alone_batched_and_streamed_bit_for_bit(arch, precision):
    """Sentences joining mid-search, leaving, moved into lower slots, in buckets of 1 to 8
    slots and other widths: each gets what it gets alone."""
    vocab = word_dictionary(24)
    model = BUILDERS[arch](vocab, 2).to(precision)
    sample = make_batch(vocab, 13, seed=6)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    # each sentence's maximum length its own (max_len_a): they end at different steps
    gen = _generator(model, vocab, beam_size=2, max_len_a=1.0, max_len_b=10)
    alone = [gen.generate([model], {"net_input": {"src_tokens": s[None], "src_lengths": None}})[0]
             for s in sentences]  # fmt: skip
    for capacity in (3, 8):
        streamed, engine = _stream(gen, sentences, capacity)
        assert engine.refills > 0
        assert_identical(alone, [streamed[i] for i in range(len(sentences))])


@pytest.mark.exact
def test_a_static_batch_bit_for_bit_as_each_sentence_alone():
    vocab = word_dictionary(24)
    model = BUILDERS["transformer"](vocab, 3)
    sample = make_batch(vocab, 11, seed=9)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    gen = _generator(model, vocab, beam_size=4)
    alone = [gen.generate([model], {"net_input": {"src_tokens": s[None], "src_lengths": None}})[0]
             for s in sentences]  # fmt: skip
    batched = gen.generate([model], sample)
    assert_identical(alone, batched)


def test_buckets_and_moves_happen(monkeypatch):
    """The stream above really runs other buckets and moves sentences into lower slots."""
    vocab = word_dictionary(24)
    model = BUILDERS["transformer"](vocab, 2, eos_boost=4.0)
    sample = make_batch(vocab, 13, seed=6)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    gen = _generator(model, vocab, beam_size=2, max_len_a=1.0, max_len_b=10)
    sizes, moves = set(), []
    step, move = FixedRows.step, FixedRows.move
    monkeypatch.setattr(FixedRows, "step", lambda self, size: (sizes.add(size), step(self, size)))
    monkeypatch.setattr(FixedRows, "move",
                        lambda self, *a: (moves.append(a), move(self, *a)))  # fmt: skip
    _stream(gen, sentences, 8)
    assert len({s.slots for s in sizes}) >= 3 and len({s.columns for s in sizes}) >= 2
    assert moves


BANNED = {"_local_scalar_dense", "nonzero", "masked_select", "lift_fresh", "is_nonzero",
          "equal", "unique", "_unique2"}  # fmt: skip


class _Capturable(TorchDispatchMode):
    """Fails on any operation that would wait for a GPU or copy host data in (a CUDA graph
    cannot capture either)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = func.overloadpacket.__name__
        if name in BANNED:
            raise AssertionError(f"the step calls {func}")
        return func(*args, **(kwargs or {}))


def test_the_step_is_capturable(vocab, monkeypatch):
    model = BUILDERS["transformer"](vocab, 1)
    sample = make_batch(vocab, 6, seed=4)
    gen = _generator(model, vocab, beam_size=3, min_len=2, unk_penalty=0.3, no_repeat_ngram_size=2)
    reference = gen.generate([model], sample)
    inner = FixedRows._step
    seen: list[Bucket] = []

    def guarded(self, size):
        seen.append(size)
        with _Capturable():
            inner(self, size)

    monkeypatch.setattr(FixedRows, "_step", guarded)
    assert_identical(reference, gen.generate([model], sample))
    assert seen
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        with _Capturable():
            torch.ones(2).sum().item()


@pytest.mark.exact
def test_cancelled_sentences_leave_and_others_are_unchanged(vocab):
    model = BUILDERS["transformer"](vocab, 2, eos_boost=4.0)
    sample = make_batch(vocab, 6, seed=8)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    gen = _generator(model, vocab, beam_size=2, max_len_a=1.0, max_len_b=10)
    alone = [gen.generate([model], {"net_input": {"src_tokens": s[None], "src_lengths": None}})[0]
             for s in sentences]  # fmt: skip
    engine = open_engine(gen.model, gen.options, max_sentences=4)
    for i, s in enumerate(sentences):
        request = sentence_request(i, s, None)
        engine.check(request)
        engine.enqueue(request)
    results = {}
    with torch.inference_mode():
        engine.admit_waiting()
        engine.step()
        engine.cancel([1, 4])
        while not engine.idle:
            engine.admit_waiting()
            results.update((f.key, f.hypotheses) for f in engine.step())
    assert sorted(results) == [0, 2, 3, 5]
    assert engine.cancelled == 2
    assert_identical([alone[i] for i in sorted(results)], [results[i] for i in sorted(results)])


@pytest.mark.parametrize(
    "options", [dict(stopping="exact"), dict(attention=True), dict(match_source_len=True)],
    ids=str,
)  # fmt: skip
def test_what_it_does_not_decode_goes_to_the_other_engine(vocab, options):
    model = BUILDERS["transformer"](vocab, 1)
    gen = _generator(model, vocab, beam_size=2, **options)
    assert isinstance(open_engine(gen.model, gen.options), DecodingEngine)
    fconv = _generator(BUILDERS["fconv"](vocab, 1), vocab, beam_size=2)
    assert isinstance(open_engine(fconv.model, fconv.options), DecodingEngine)


@pytest.mark.parametrize("options", [dict(beam_size=3), dict(beam_size=2, min_len=4,
                                                         tokens_to_suppress=("w3",))], ids=str)
def test_forced_prefixes_as_the_other_engine_and_fairseq(vocab, options):
    model = BUILDERS["transformer"](vocab, 1)
    sample = make_batch(vocab, 6, seed=12)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(vocab.nspecial, len(vocab), (6, 3), generator=g)
    prefix[1, 1] = prefix[3, 0] = prefix[4, 2] = vocab.pad()  # free choice there
    ours = _generator(model, vocab, **options)
    out = ours.generate([model], sample, prefix_tokens=prefix)
    other = _generator(model, vocab, device_engine="off", **options)
    assert_same(other.generate([model], sample, prefix_tokens=prefix), out, check_attention=False)
    if "tokens_to_suppress" not in options:
        ref = FairseqGenerator([model], vocab, max_len_b=20, **options)
        assert_same(ref.generate([model], sample, prefix_tokens=prefix), out,
                    check_attention=False)  # fmt: skip


def test_prefixes_that_force_eos_as_the_other_engine_and_fairseq(vocab):
    """A prefix that holds EOS (a short reference under fairseq-generate --prefix-size): every
    beam becomes a copy of the first there, as in fairseq."""
    model = BUILDERS["transformer"](vocab, 2)
    sample = make_batch(vocab, 5, seed=13)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(vocab.nspecial, len(vocab), (5, 3), generator=g)
    prefix[0, 1] = prefix[2, 2] = vocab.eos()
    prefix[0, 2] = vocab.pad()
    ours = _generator(model, vocab, beam_size=3)
    out = ours.generate([model], sample, prefix_tokens=prefix)
    other = _generator(model, vocab, beam_size=3, device_engine="off")
    assert_same(other.generate([model], sample, prefix_tokens=prefix), out, check_attention=False)
    ref = FairseqGenerator([model], vocab, beam_size=3, max_len_b=20)
    assert_same(ref.generate([model], sample, prefix_tokens=prefix), out, check_attention=False)


def test_auto_keeps_the_other_engine_on_the_cpu(vocab):
    model = BUILDERS["transformer"](vocab, 1)
    gen = _generator(model, vocab, beam_size=2, device_engine="auto")
    assert isinstance(open_engine(gen.model, gen.options), DecodingEngine)


def test_float32_products_in_fixed_chunks_give_a_row_the_same_bits_whatever_its_neighbours():
    """What float32 products on a GPU go through (cuBLAS picks its algorithm by the row count):
    chunks of exactly ROW_CHUNK rows, the last padded."""
    from beamplugin.modules.plain_linear import ROW_CHUNK, rows_in_chunks

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x = torch.randn(3 * ROW_CHUNK + 7, 32, generator=g)
    alone = rows_in_chunks(x[:5], weight, bias)
    for rows in (6, ROW_CHUNK, ROW_CHUNK + 1, x.size(0)):
        out = rows_in_chunks(x[:rows], weight, bias)
        assert out.shape == (rows, 48)
        assert torch.equal(out[:5], alone)
    torch.testing.assert_close(rows_in_chunks(x, weight, bias),
                               torch.nn.functional.linear(x, weight, bias))  # fmt: skip

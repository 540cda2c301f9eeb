"""How often the search makes the host wait for the device, counted on the CPU (see
host_syncs.py): once per step, once more on a step where hypotheses finish, and no more."""

from __future__ import annotations

import pytest
import torch
from builders import BUILDERS, assert_same, count_rows, make_batch
from fairseq import utils
from host_syncs import as_device, counting_syncs

from beamplugin import SequenceGenerator
from beamplugin.engine import DecodingEngine
from beamplugin.engine.finalizer import Finalizer
from beamplugin.streams import IteratorSource, run, sentence_request

# the search's own waits: in the engine's modules
ENGINE_FILES = ("engine.py", "scheduler.py", "slots.py", "model_runner.py", "finalizer.py")
STEP = "to_host from finalizer.py:status"
FINISH = "to_host from finalizer.py:_store"


def engine_syncs(syncs: dict[str, int]) -> dict[str, int]:
    return {site: n for site, n in syncs.items() if site.split(":")[0].endswith(ENGINE_FILES)}


def count_finishing_steps(monkeypatch: pytest.MonkeyPatch, steps: list[int]) -> set[int]:
    """The steps (numbered by ``steps``, count_rows' record) in which hypotheses were stored."""
    finishing: set[int] = set()
    store = Finalizer._store

    def recording(self, *args, **kwargs):
        finishing.add(len(steps))
        return store(self, *args, **kwargs)

    monkeypatch.setattr(Finalizer, "_store", recording)
    return finishing


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize(
    "options",
    [
        dict(beam_size=4),
        dict(beam_size=1),
        dict(beam_size=4, min_len=20),  # nothing finishes before the last step
        dict(beam_size=4, stopping="exact", len_penalty=0.5),
        dict(beam_size=4, match_source_len=True),
    ],
    ids=str,
)
def test_one_sync_per_step_and_one_per_finishing_step(vocab, models, arch, options, monkeypatch):
    model = models[arch][0]
    sample = make_batch(vocab, 8, seed=3)
    gen = SequenceGenerator([model], vocab, max_len_b=20, **options)
    reference = gen.generate([model], sample)
    steps = count_rows(gen)
    finishing = count_finishing_steps(monkeypatch, steps)
    with counting_syncs(monkeypatch) as syncs:
        out = gen.generate([model], as_device(sample))
    assert_same(reference, out)  # counting changed nothing
    search = engine_syncs(syncs)
    # once per batch, before the loop: the output length limit of match_source_len
    per_batch = (
        {"to_host from scheduler.py:_output_limit": 1} if options.get("match_source_len") else {}
    )
    assert search == {STEP: len(steps), FINISH: len(finishing), **per_batch}, syncs
    assert len(finishing) < len(steps)
    # the decoder steps never wait (fairseq's transformer's too, on our mixed-step path); the
    # encoder checks its padding once a batch (fairseq's transformer encoder thrice; our kernels'
    # reads its sources' widths, which on a GPU fairseq's layers do not)
    model_syncs = {site: n for site, n in syncs.items() if site not in search}
    encoder_sites = {"sinusoidal_positional_embedding.py:forward",
                     "transformer_encoder.py:forward_scriptable",
                     "mixed_step_transformer.py:forward_torchscript"}
    if arch == "transformer":
        assert set(model_syncs) <= encoder_sites and sum(model_syncs.values()) <= 3, model_syncs
    else:
        assert sum(model_syncs.values()) <= 1, model_syncs


def test_prefix_tokens_add_one_sync_per_batch(vocab, models, monkeypatch):
    model = models["convs2s"][0]
    sample = make_batch(vocab, 6, seed=4)
    prefix = sample["net_input"]["src_tokens"][:, -3:].clone()
    prefix[1, 1] = vocab.eos()  # a prefix that ends early
    prefix[2, 2] = vocab.pad()  # and a free choice
    gen = SequenceGenerator([model], vocab, beam_size=3, max_len_b=15)
    reference = gen.generate([model], sample, prefix_tokens=prefix)
    steps = count_rows(gen)
    finishing = count_finishing_steps(monkeypatch, steps)
    with counting_syncs(monkeypatch) as syncs:
        out = gen.generate([model], as_device(sample), prefix_tokens=as_device(prefix))
    assert_same(reference, out)
    assert syncs[STEP] == len(steps) and syncs[FINISH] == len(finishing)
    assert syncs["to_host from slots.py:allocate"] == 1


def test_a_real_wait_is_counted(vocab, models, monkeypatch):
    """The counter itself: a .item() on a device tensor inside the loop would be seen."""
    model = models["convs2s"][0]
    gen = SequenceGenerator([model], vocab, beam_size=2, max_len_b=6)
    steps = count_rows(gen)
    decode_step = gen.model.decode_step

    def waiting(*args, **kwargs):
        lprobs, attn = decode_step(*args, **kwargs)
        lprobs.max().item()
        return lprobs, attn

    gen.model.decode_step = waiting
    with counting_syncs(monkeypatch) as syncs:
        gen.generate([model], as_device(make_batch(vocab, 2, seed=1)))
    assert syncs["test_host_syncs.py:waiting"] == len(steps), syncs


def test_a_stream_syncs_once_per_step_and_per_finishing_step(vocab, models, monkeypatch):
    """Continuous batching adds no wait to a step: admitting sentences into freed slots costs
    only the encoder's padding check, once per encoder forward."""
    model = models["convs2s"][0]
    sample = make_batch(vocab, 9, seed=5)
    sentences = [utils.strip_pad(row, vocab.pad()) for row in sample["net_input"]["src_tokens"]]
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    steps = count_rows(gen)
    finishing = count_finishing_steps(monkeypatch, steps)
    forwards = []
    encode = gen.model.encode

    def recording(net_input):
        forwards.append(len(net_input["src_tokens"]))
        return encode(net_input)

    gen.model.encode = recording
    engine = DecodingEngine.of(gen, max_sentences=3)
    requests = [sentence_request(i, as_device(s), None) for i, s in enumerate(sentences)]
    with counting_syncs(monkeypatch) as syncs, torch.inference_mode():
        finished = list(run(engine, IteratorSource(requests)))
    assert sorted(f.key for f in finished) == list(range(9)) and engine.refills > 0
    search = engine_syncs(syncs)
    assert search == {STEP: len(steps), FINISH: len(finishing)}, syncs
    model_syncs = {site: n for site, n in syncs.items() if site not in search}
    assert model_syncs == {"convs2s.py:forward": len(forwards)}, syncs

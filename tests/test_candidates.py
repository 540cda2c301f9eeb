"""Our kernel for a beam search step's candidates (beamplugin/kernels/native/candidates.c):
torch.topk's candidates, scores and order for every shape the search gives it, torch's own
order where scores are equal or NaN, the same with threads, bad inputs refused."""

from __future__ import annotations

import math

import pytest
import torch

from beamplugin.kernels import candidates, instruction_sets, native_library
from beamplugin.kernels.native_library import INT, POINTER, SIZE

pytestmark = [
    pytest.mark.exact,
    pytest.mark.skipif(
        candidates._kernel() is None, reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)"
    ),
]


def expected(lprobs: torch.Tensor, scores: torch.Tensor, k: int):
    return torch.topk((lprobs + scores.unsqueeze(2)).view(lprobs.size(0), -1), k)


def assert_topk(lprobs: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    values, indices = candidates.top_candidates(lprobs, scores, k)
    want_values, want_indices = expected(lprobs, scores, k)
    assert torch.equal(values, want_values)
    assert torch.equal(indices, want_indices)


@pytest.mark.parametrize(
    "sentences, beams, vocab",
    [(1, 1, 3992), (1, 5, 3992), (64, 5, 3992), (3, 4, 8001), (7, 3, 17), (2, 8, 32000)],
)
def test_the_candidates_are_torchs_topk_of_the_sums(sentences, beams, vocab):
    g = torch.Generator().manual_seed(vocab + beams)
    # the search passes the first hypotheses of each sentence's beam rows: a strided view
    lprobs = torch.randn(sentences, 8, vocab, generator=g).log_softmax(-1)[:, :beams]
    lprobs[:, :, 1] = -math.inf  # pad
    scores = torch.randn(sentences, beams, generator=g) * 5
    # taken where it is faster than torch (beamplugin.kernels.trials): a tiny vocabulary may not
    assert candidates.serves(lprobs) or vocab < 1000
    for k in {2 * beams, min(16, beams * vocab - 1), 1}:
        assert_topk(lprobs, scores, k)


def test_few_live_words_and_all_but_one_candidate():
    """At the maximum length only EOS lives; a tiny vocabulary asks for all but one."""
    lprobs = torch.full((4, 5, 3992), -math.inf)
    lprobs[:, :, 2] = torch.randn(4, 5).log_softmax(-1)
    scores = torch.randn(4, 5)
    assert_topk(lprobs, scores, 10)
    small = torch.randn(6, 3, 4).log_softmax(-1)
    assert_topk(small, torch.randn(6, 3), 3 * 4 - 1)


def test_equal_scores_and_nan_take_torchs_order():
    g = torch.Generator().manual_seed(1)
    lprobs = -torch.randint(0, 4, (8, 5, 400), generator=g).float()  # many exact ties
    scores = -torch.randint(0, 3, (8, 5), generator=g).float()
    assert_topk(lprobs, scores, 10)
    lprobs = torch.randn(3, 5, 2000).log_softmax(-1)
    lprobs[1, 2, 777] = math.nan
    values, indices = candidates.top_candidates(lprobs, torch.zeros(3, 5), 10)
    assert math.isnan(values[1, 0]) and indices[1, 0] == 2 * 2000 + 777
    lprobs[1, 2, 777] = lprobs[1, 2, 778]  # a tie only at the k-th place
    assert_topk(lprobs, torch.zeros(3, 5), 10)


def test_torch_ranks_ties_a_few_sentences_at_a_time_as_all_at_once(monkeypatch):
    """Where ties leave the order to torch.topk, it ranks a few sentences' sums at a time (not a
    [64 x 5 x 256k] tensor): each sentence's ranking is the one it gets among all."""
    g = torch.Generator().manual_seed(3)
    lprobs = -torch.randint(0, 4, (13, 5, 3000), generator=g).float()  # many exact ties
    lprobs[::4] = -math.inf  # sentences at their maximum length: only EOS lives
    lprobs[::4, :, 2] = torch.randn(4, 5, generator=g)
    scores = -torch.randint(0, 3, (13, 5), generator=g).float()
    monkeypatch.setattr(candidates, "TORCH_RANKS_BYTES", 3 * 5 * 3000 * 4)  # 3 sentences
    values, indices = candidates.torch_top_candidates(lprobs, scores, 10)
    want_values, want_indices = expected(lprobs, scores, 10)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    assert_topk(lprobs, scores, 10)  # the kernel leaves these ties to it


def test_threads_change_nothing():
    lprobs = torch.randn(64, 5, 3992).log_softmax(-1)
    scores = torch.randn(64, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = candidates.top_candidates(lprobs, scores, 10)
        torch.set_num_threads(2)
        two = candidates.top_candidates(lprobs, scores, 10)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_bad_inputs_are_refused():
    lprobs = torch.randn(2, 3, 50)
    with pytest.raises(ValueError, match="scores"):
        candidates.top_candidates(lprobs, torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="k 151"):
        candidates.top_candidates(lprobs, torch.zeros(2, 3), 151)
    with pytest.raises(ValueError, match="lprobs"):
        candidates.top_candidates(lprobs.transpose(1, 2).contiguous().transpose(1, 2),
                                  torch.zeros(2, 3), 5)  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        candidates.top_candidates(lprobs, torch.zeros(2, 3, dtype=torch.float64), 5)
    assert not candidates.serves(lprobs.double())


@pytest.mark.parametrize("sentences, beams, vocab, beam_size", [
    (1, 1, 3992, 5), (1, 5, 3992, 5), (64, 5, 3992, 5), (7, 3, 17, 3), (4, 4, 3, 4), (3, 8, 500, 8),
    (2, 2, 3, 4),  # k - beams < beam: dead slots
])  # fmt: skip
def test_the_beam_step_is_the_torch_steps(monkeypatch, sentences, beams, vocab, beam_size):
    """fairseq's step (beamplugin.search.beam_step) in one call, field by field, EOS ranked
    high and masked, a vocabulary too small for beam non-EOS candidates."""
    from beamplugin.search.beam_step import beam_step

    g = torch.Generator().manual_seed(vocab + beams)
    lprobs = torch.randn(sentences, beams, vocab, generator=g).log_softmax(-1)
    eos = 2
    lprobs[:, :, min(eos, vocab - 1)] += 1.5  # EOS among the best
    lprobs[0, :, eos % vocab] = -math.inf  # masked EOS: a dead candidate, not a finished one
    scores = torch.randn(sentences, beams, generator=g) * 3
    ours = beam_step(lprobs, scores, beam_size, eos)
    with monkeypatch.context() as patch:
        patch.setattr(candidates, "serves", lambda lprobs: False)
        theirs = beam_step(lprobs, scores, beam_size, eos)
    for field, a, b in zip(ours._fields, ours, theirs, strict=True):
        if field == "first_nan":  # our kernel leaves NaN to torch: it reports none
            assert (a is None or not a.any()) and not b.any()
        else:
            assert torch.equal(a, b), field


def test_torch_ranks_only_the_sentences_whose_ties_it_orders(monkeypatch):
    """A tie or a NaN in one sentence of a batch leaves that sentence to torch.topk, the others
    to the kernel: the candidates, and the beam step made of them, are torch's for all."""
    from beamplugin.search.beam_step import beam_step

    g = torch.Generator().manual_seed(7)
    lprobs = torch.randn(16, 5, 3000, generator=g).log_softmax(-1)
    lprobs[3] = -torch.randint(0, 4, (5, 3000), generator=g).float()  # many exact ties
    lprobs[9, 1, 5] = math.nan
    lprobs[12, 4, 100] = lprobs[12, 4, 101] = 30.0  # two equal bests
    scores = torch.randn(16, 5, generator=g)
    ranked = []
    torchs = candidates.torch_top_candidates
    def counted(lprobs: torch.Tensor, *rest):
        ranked.append(len(lprobs))
        return torchs(lprobs, *rest)

    monkeypatch.setattr(candidates, "torch_top_candidates", counted)
    values, indices = candidates.top_candidates(lprobs, scores, 10)
    want_values, want_indices = expected(lprobs, scores, 10)
    assert ranked == [3]
    assert torch.equal(indices, want_indices)
    assert torch.equal(values.nan_to_num(), want_values.nan_to_num())
    ours = beam_step(lprobs, scores, 5, eos=2)
    assert ranked == [3, 3]
    kernels_step = candidates.beam_step
    monkeypatch.setattr(candidates, "beam_step", lambda lprobs, *rest: (
        kernels_step(lprobs, *rest)[0], torch.arange(len(lprobs))))  # fmt: skip
    theirs = beam_step(lprobs, scores, 5, eos=2)  # every sentence in torch's order
    assert ranked == [3, 3, 16]
    for field, a, b in zip(ours._fields, ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num() if a.is_floating_point() else a,
                           b.nan_to_num() if b.is_floating_point() else b), field  # fmt: skip


@pytest.mark.parametrize("isa", [i for i in instruction_sets.SETS if instruction_sets.runs_here(i)],
                         ids=lambda isa: isa.name)  # fmt: skip
def test_each_instruction_sets_build_finds_torchs_candidates(isa):
    """The kernel built for each set this CPU runs (AVX2's on an AVX-512 machine too) gives
    torch's candidates."""
    argtypes = [POINTER, SIZE, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, *[POINTER] * 3, INT]
    kernel = native_library.function("candidates", "top_candidates", argtypes, SIZE, isa)
    if kernel is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(5)
    for sentences, beams, vocab in [(1, 5, 3992), (64, 5, 3992), (3, 4, 8001), (7, 3, 17)]:
        lprobs = torch.randn(sentences, beams, vocab, generator=g).log_softmax(-1)
        scores = torch.randn(sentences, beams, generator=g) * 5
        k = 2 * beams
        values, indices = torch.empty(sentences, k), torch.empty(sentences, k, dtype=torch.int64)
        unsure_rows = torch.ones(sentences, dtype=torch.bool)
        unsure = kernel(lprobs.data_ptr(), lprobs.stride(0), lprobs.stride(1), scores.data_ptr(),
                        sentences, beams, vocab, k, values.data_ptr(), indices.data_ptr(),
                        unsure_rows.data_ptr(), 1)  # fmt: skip
        assert unsure == 0 and not unsure_rows.any(), (sentences, beams, vocab)
        want_values, want_indices = expected(lprobs, scores, k)
        assert torch.equal(values, want_values) and torch.equal(indices, want_indices)


def test_at_a_sentences_last_step_its_dead_candidates_are_left_to_no_one(monkeypatch):
    """At the maximum length only EOS lives: the dead candidates (score -inf) that fill the
    last places may be any (they never finish, and nothing follows), so a sentence at its last
    step is not handed to torch.topk for them; its live candidates and its step are torch's.
    Before the last step the same sentences keep torch's order, dead ones included."""
    from beamplugin.search.beam_step import beam_step

    g = torch.Generator().manual_seed(5)
    lprobs = torch.randn(6, 5, 3992, generator=g).log_softmax(-1)
    lprobs[::2] = -math.inf  # at their maximum length: every word but EOS dead
    lprobs[::2, :, 2] = torch.randn(3, 5, generator=g).log_softmax(-1)
    scores = torch.randn(6, 5, generator=g)
    last = torch.tensor([True, False] * 3)
    with monkeypatch.context() as patch:
        patch.setattr(candidates, "serves", lambda lprobs: False)
        theirs = beam_step(lprobs, scores, 5, eos=2)
    before = beam_step(lprobs, scores, 5, eos=2)  # no last step: torch's order for all
    for field in before._fields[:-1]:
        assert torch.equal(getattr(before, field), getattr(theirs, field)), field
    ranked = []
    torch_ranks = candidates.torch_top_candidates
    monkeypatch.setattr(
        candidates, "torch_top_candidates", lambda *args: ranked.append(args) or torch_ranks(*args)
    )
    ours = beam_step(lprobs, scores, 5, eos=2, last_step=last)
    assert ranked == []  # the other sentences have no ties: nothing for torch to order
    live = theirs.cand_scores.isfinite()
    assert live.sum(1).tolist() == [5, 10] * 3
    for field in ("cand_scores", "cand_tokens", "cand_beams"):
        mine, want = getattr(ours, field), getattr(theirs, field)
        assert torch.equal(mine[live], want[live]), field
    assert torch.equal(ours.cand_scores, theirs.cand_scores)  # the dead ones -inf too
    assert bool((ours.cand_beams < 5).all() and (ours.cand_tokens < 3992).all())
    assert torch.equal(ours.finalize, theirs.finalize) and bool(ours.finalize[::2].all())
    for field in ("alive_beams", "alive_tokens", "alive_scores"):  # the others', as torch's
        assert torch.equal(getattr(ours, field)[1::2], getattr(theirs, field)[1::2]), field
    assert bool(ours.alive_scores[::2].eq(-math.inf).all())
    with pytest.raises(ValueError, match="last_step"):
        beam_step(lprobs, scores, 5, eos=2, last_step=last[:4])


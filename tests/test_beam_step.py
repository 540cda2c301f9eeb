"""The pure search step on hand-made log-prob tables (no model)."""

from __future__ import annotations

import math

import pytest
import torch
from builders import fairseq_reference

from beamplugin.kernels import candidates
from beamplugin.search import beam_step, block_repeated_ngrams, concat_steps, length_normaliser
from beamplugin.search.beam_step import CHUNKED_TOPK_MIN_SIZE, chunk_size, top_candidates

INF = math.inf
EOS = 2  # fairseq's Dictionary: <s>=0, <pad>=1, </s>=2, <unk>=3, words from 4


def table(*rows: list[float]) -> torch.Tensor:
    """One sentence: ``[1, len(rows), vocab]`` log-probs."""
    return torch.tensor([list(r) for r in rows]).unsqueeze(0)


def as_lists(res) -> dict:
    """Every field of ``res`` as lists; ``first_nan`` None (none can be) as all False."""
    lists = {name: getattr(res, name) for name in res._fields}
    if lists["first_nan"] is None:
        lists["first_nan"] = torch.zeros(res.cand_scores.size(0), 1, dtype=torch.bool)
    return {name: value.tolist() for name, value in lists.items()}


def test_eos_in_top_half_finishes_and_leaves_the_beam():
    # totals: beam0: EOS -0.5, w3 -1.0, w4 -2.0; beam1 (score -1): EOS -4.0, w3 -1.2, w4 -5.0
    lprobs = table([-INF, -INF, -0.5, -1.0, -2.0], [-INF, -INF, -3.0, -0.2, -4.0])
    res = beam_step(lprobs, torch.tensor([[0.0, -1.0]]), beam_size=2, eos=EOS)
    assert res.cand_tokens.tolist() == [[2, 3, 3, 4]]
    assert res.cand_beams.tolist() == [[0, 0, 1, 0]]
    assert res.cand_scores[0].tolist() == pytest.approx([-0.5, -1.0, -1.2, -2.0])
    assert res.finalize.tolist() == [[True, False]]
    assert res.alive_beams.tolist() == [[0, 1]]
    assert res.alive_tokens.tolist() == [[3, 3]]
    assert res.alive_scores[0].tolist() == pytest.approx([-1.0, -1.2])


def test_eos_in_bottom_half_does_not_finish():
    # beam0's EOS (-1.5) ranks third of four: not inside the top beam=2 slots
    lprobs = table([-INF, -INF, -1.5, -1.0, -2.0], [-INF, -INF, -3.0, -0.2, -4.0])
    res = beam_step(lprobs, torch.tensor([[0.0, -1.0]]), beam_size=2, eos=EOS)
    assert res.cand_tokens.tolist() == [[3, 3, 2, 4]]
    assert res.finalize.tolist() == [[False, False]]
    assert res.alive_beams.tolist() == [[0, 1]]
    assert res.alive_tokens.tolist() == [[3, 3]]
    assert res.alive_scores[0].tolist() == pytest.approx([-1.0, -1.2])


def test_all_beams_end_at_once_and_next_beam_comes_from_bottom_half():
    lprobs = table([-INF, -INF, -0.1, -3.0, -4.0], [-INF, -INF, -0.2, -3.5, -2.5])
    res = beam_step(lprobs, torch.tensor([[0.0, 0.0]]), beam_size=2, eos=EOS)
    assert res.cand_tokens.tolist() == [[2, 2, 4, 3]]
    assert res.cand_beams.tolist() == [[0, 1, 1, 0]]
    assert res.finalize.tolist() == [[True, True]]
    assert res.alive_beams.tolist() == [[1, 0]]
    assert res.alive_tokens.tolist() == [[4, 3]]
    assert res.alive_scores[0].tolist() == pytest.approx([-2.5, -3.0])


def test_max_length_step_finishes_every_beam():
    # at max length the generator leaves only EOS finite: every beam ends, the rest is dead
    lprobs = table([-INF, -INF, -0.7, -INF, -INF], [-INF, -INF, -0.3, -INF, -INF])
    res = beam_step(lprobs, torch.tensor([[-1.0, -2.0]]), beam_size=2, eos=EOS)
    assert res.cand_tokens[0, :2].tolist() == [2, 2]
    assert res.cand_beams[0, :2].tolist() == [0, 1]
    assert res.cand_scores[0, :2].tolist() == pytest.approx([-1.7, -2.3])
    assert res.finalize.tolist() == [[True, True]]
    assert res.alive_scores.tolist() == [[-INF, -INF]]


def test_masked_eos_is_an_ordinary_dead_candidate():
    # first step (one live beam); EOS masked to -inf as before min_len: never finishes
    lprobs = table([-INF, -INF, -INF, -1.0])
    res = beam_step(lprobs, torch.zeros(1, 1), beam_size=2, eos=EOS)
    assert res.cand_scores.shape == (1, 3)  # k = min(2 * beam, vocab - 1)
    assert res.finalize.tolist() == [[False, False]]
    assert res.alive_tokens[0, 0].item() == 3
    assert res.alive_beams.tolist() == [[0, 0]]
    assert res.alive_scores.tolist() == [[-1.0, -INF]]


def test_too_few_non_eos_candidates_leave_dead_slots():
    # vocab of 4 and beam 3 at the first step: 3 candidates, one is EOS, two continue
    lprobs = table([-INF, -2.0, -0.5, -1.0])
    res = beam_step(lprobs, torch.zeros(1, 1), beam_size=3, eos=EOS)
    assert res.finalize.tolist() == [[True, False, False]]
    assert res.alive_tokens[0, :2].tolist() == [3, 1]
    assert res.alive_scores.tolist() == [[-1.0, -2.0, -INF]]


def test_sentences_are_independent():
    one = table([-INF, -INF, -0.5, -1.0, -2.0], [-INF, -INF, -3.0, -0.2, -4.0])
    two = table([-INF, -INF, -0.1, -3.0, -4.0], [-INF, -INF, -0.2, -3.5, -2.5])
    scores = torch.tensor([[0.0, -1.0], [0.0, 0.0]])
    both = beam_step(torch.cat([one, two]), scores, beam_size=2, eos=EOS)
    for i, single in enumerate((one, two)):
        alone = beam_step(single, scores[i : i + 1], beam_size=2, eos=EOS)
        for name, value in as_lists(alone).items():
            assert as_lists(both)[name][i : i + 1] == value, name


@pytest.mark.parametrize("beam", [1, 2, 3, 5])
@pytest.mark.parametrize("step", [0, 4])
def test_ties_and_random_tables_match_fairseq(beam, step):
    # Quantised log-probs make many exact ties; torch.topk must break them as in fairseq.
    g = torch.Generator().manual_seed(beam * 10 + step)
    vocab = 12
    in_beam = 1 if step == 0 else beam
    for _ in range(20):
        lprobs = -torch.randint(0, 4, (3, in_beam, vocab), generator=g).float()
        lprobs[:, :, 1] = -INF  # pad
        scores = -torch.randint(0, 3, (3, in_beam), generator=g).float()
        if step == 0:
            scores.zero_()
        ours = beam_step(lprobs, scores, beam_size=beam, eos=EOS)
        cand_scores, cand_tokens, cand_beams, finalize, active = fairseq_reference(
            lprobs, scores, beam, step
        )
        assert ours.cand_scores.tolist() == cand_scores.tolist()
        assert ours.cand_tokens.tolist() == cand_tokens.tolist()
        assert ours.cand_beams.tolist() == cand_beams.tolist()
        assert ours.finalize.tolist() == finalize.tolist()
        assert ours.alive_tokens.tolist() == cand_tokens.gather(1, active).tolist()
        assert ours.alive_beams.tolist() == cand_beams.gather(1, active).tolist()
        assert ours.alive_scores.tolist() == cand_scores.gather(1, active).tolist()


@pytest.fixture
def chunked(monkeypatch):
    """torch's chunked top-k, as on a GPU or without a C compiler (not our kernel)."""
    monkeypatch.setattr(candidates, "serves", lambda lprobs: False)


@pytest.mark.usefixtures("chunked")
@pytest.mark.parametrize(
    "bsz, in_beam, vocab",
    [(40, 5, 2000), (64, 1, 8000), (30, 8, 1000), (1, 5, 8000), (3, 4, 8008), (2, 3, 32000)],
)
def test_chunked_top_candidates_equal_a_full_topk(bsz, in_beam, vocab):
    # random floats have no ties, so the order is fixed too
    assert bsz * in_beam * vocab >= CHUNKED_TOPK_MIN_SIZE and chunk_size(vocab, -(-16 // in_beam))
    g = torch.Generator().manual_seed(vocab)
    beam = 8
    lprobs = torch.randn(bsz, beam, vocab, generator=g).log_softmax(-1)[:, :in_beam]
    lprobs[:, :, 1] = -INF
    lprobs[0, 0, 100:] = -INF  # a hypothesis with few live tokens
    scores = torch.randn(bsz, in_beam, generator=g) * 5
    k = 2 * beam
    values, indices = top_candidates(lprobs, scores, k)
    ref_values, ref_indices = torch.topk((lprobs + scores.unsqueeze(2)).view(bsz, -1), k)
    assert torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)


@pytest.mark.usefixtures("chunked")
def test_chunked_top_candidates_put_nan_first():
    lprobs = torch.randn(40, 5, 2000).log_softmax(-1)
    lprobs[3, 2, 777] = math.nan
    values, indices = top_candidates(lprobs, torch.zeros(40, 5), 10)
    assert math.isnan(values[3, 0]) and indices[3, 0] == 2 * 2000 + 777
    assert not values[[0, 1, 2, 4]].isnan().any()


def test_length_normalisers():
    assert length_normaliser(4, 1.0, "fairseq") == 4.0
    assert length_normaliser(9, 0.5, "fairseq") == 3.0
    assert length_normaliser(4, 0.0, "fairseq") == 1.0
    assert length_normaliser(7, 1.0, "gnmt") == 2.0
    assert length_normaliser(31, 0.5, "gnmt") == pytest.approx(math.sqrt(6.0))


@pytest.mark.parametrize(
    "tokens, n, banned",
    [
        ([2, 5, 6, 5], 2, {6}),  # "5 6" seen: after a 5, 6 is banned
        ([2, 5, 6, 5], 3, set()),  # "6 5" never seen before
        ([2, 5, 6, 5, 6], 3, {5}),  # "5 6 5" seen
        ([2, 5, 5], 2, {5}),
        ([2, 5, 6], 1, {5, 6}),  # unigrams: every generated token, not BOS
        ([2, 5], 3, set()),  # too short
        # left-padded (pad = 1), as rows of sentences at different steps are
        ([1, 1, 2, 5, 6], 1, {5, 6}),
        ([1, 2, 5, 6, 5], 2, {6}),
        ([1, 1, 2, 5, 5], 2, {5}),
        ([1, 1, 1, 2, 5], 3, set()),
        ([1, 1, 1, 1, 2], 2, set()),
    ],
)
def test_block_repeated_ngrams(tokens, n, banned):
    lprobs = torch.full((2, 8), -1.0)
    rows = torch.tensor([tokens, tokens])
    block_repeated_ngrams(rows, lprobs, n, 1)
    for row in lprobs:
        assert {i for i, v in enumerate(row.tolist()) if v == -INF} == banned


def test_block_repeated_ngrams_rows_are_independent():
    lprobs = torch.full((2, 8), -1.0)
    block_repeated_ngrams(torch.tensor([[2, 4, 7, 4], [2, 4, 6, 5]]), lprobs, 2, 1)
    assert lprobs[0, 7] == -INF and lprobs[0].isinf().sum() == 1
    assert not lprobs[1].isinf().any()



def test_a_nan_log_prob_is_reported_where_it_ranks_first():
    lprobs = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(4))
    clean = beam_step(lprobs, torch.zeros(3, 2), beam_size=2, eos=EOS)
    assert as_lists(clean)["first_nan"] == [[False]] * 3
    lprobs[1, 1, 9] = math.nan  # torch.topk ranks NaN first: sentence 1 only
    res = beam_step(lprobs, torch.zeros(3, 2), beam_size=2, eos=EOS)
    assert res.first_nan.tolist() == [[False], [True], [False]]
    # joined to a step whose search saw no NaN, its sentences read False
    assert concat_steps(clean, res).first_nan.view(-1).tolist() == [False] * 4 + [True, False]

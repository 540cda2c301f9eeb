"""Our log-softmax of the decoder's logits (beamplugin/kernels/native/log_softmax.c, applied by
beamplugin/kernels/log_probs.py): torch.log_softmax's values within a few ulp at every width,
its -inf and NaN, each row's bits its own whatever rows and threads are beside it, and torch's
own where our kernels are off."""

from __future__ import annotations

import math

import pytest
import torch

from beamplugin.engine.ensemble import search_log_probs
from beamplugin.kernels import log_probs

needs_kernel = pytest.mark.skipif(
    log_probs._kernel() is None, reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)"
)


def logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + vocab)
    return torch.randn(rows, vocab, generator=g) * 4


def ours(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    assert log_probs.log_softmax_(x)
    return x


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 3, 15, 16, 17, 100, 1031, 8000, 8003])
def test_rows_are_torchs_log_softmax(vocab):
    x = logits(37, vocab)
    x[::5, : vocab // 2 : 3] = -math.inf  # masked words (the first column of single columns)
    want = torch.log_softmax(x, -1)
    got = ours(x)
    assert torch.equal(got.isneginf(), want.isneginf())
    finite = want.isfinite()
    # a few ulp of the large log-probs; near 0, what torch's own sum of exps is off by
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=3e-6)
    # as close to the exact log-softmax as torch's, over all words and over the likely ones
    exact = torch.log_softmax(x.double(), -1)
    for words in (finite, finite & (exact > -1)):
        error = (got[words] - exact[words]).abs().max()
        assert error <= 1.5 * (want[words] - exact[words]).abs().max() + 1e-7


@needs_kernel
def test_nan_inf_and_empty_rows_give_torchs_nan():
    x = logits(6, 40)
    x[0, 7] = math.nan
    x[1, 39] = math.inf
    x[2] = -math.inf
    x[3, :39] = -math.inf  # one word left: log-prob 0
    x[4, 3] = -math.inf
    x[5, 0] = math.nan
    x[5, 1:] = -math.inf
    want = torch.log_softmax(x, -1)
    got = ours(x)
    assert torch.equal(got.isnan(), want.isnan()) and got[:3].isnan().all()
    assert torch.equal(got.isneginf(), want.isneginf())
    assert got[3, 39] == want[3, 39] == 0.0
    torch.testing.assert_close(got[4], want[4], rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.exact
def test_a_row_has_its_bits_alone_in_a_batch_and_on_any_threads():
    batch = logits(320, 8003)
    batch[3, :100] = -math.inf
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ours(batch)
        torch.set_num_threads(2)
        two_threads = ours(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    for row in (0, 3, 161, 319):
        assert torch.equal(ours(batch[row : row + 1]), one_thread[row : row + 1])
    # padded with -inf (a shortlist's row beside a longer one): its columns keep their bits
    for width in (1, 17, 64, 100, 4000):
        padded = torch.cat([batch[:2, :width], torch.full((2, 8003 - width), -math.inf)], 1)
        assert torch.equal(ours(padded)[:, :width], ours(batch[:2, :width]))
    # rows of a wider buffer (a view): the same bits, the columns beyond left as they were
    wide = torch.cat([batch[:5], torch.full((5, 13), 7.0)], 1)
    assert log_probs.log_softmax_(wide[:, :8003])
    assert torch.equal(wide[:, :8003], one_thread[:5]) and (wide[:, 8003:] == 7.0).all()


@needs_kernel
@pytest.mark.exact
def test_the_search_reads_our_log_probs_of_a_steps_logits():
    model = torch.nn.Module()
    model.plain_softmax = True
    step = logits(10, 8000).unsqueeze(1)  # [rows, 1, vocab], as a decoder step gives them
    want = ours(step.squeeze(1) / 2)
    got = search_log_probs(model, step, None, temperature=2.0)
    assert got.data_ptr() == step.data_ptr() and torch.equal(got, want)


@pytest.mark.exact
def test_torchs_where_our_kernels_are_off_or_the_logits_are_not_ours(kernels_for):
    x = logits(5, 8000)
    assert not log_probs.log_softmax_(x.double())
    kernels_for("off")
    model = torch.nn.Module()
    model.plain_softmax = True
    step = x.clone().unsqueeze(1)
    assert not log_probs.log_softmax_(step)
    assert torch.equal(step.squeeze(1), x)
    got = search_log_probs(model, step, None, temperature=1.0)
    assert torch.equal(got, torch.log_softmax(x, -1))

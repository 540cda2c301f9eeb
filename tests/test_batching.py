import numpy as np
import pytest
from fairseq.data import data_utils

from beamplugin.fairseq_plugin.batching import batch_by_size

CONFIGS = [
    dict(max_tokens=4000, max_sentences=None, required_batch_size_multiple=8),
    dict(max_tokens=None, max_sentences=10, required_batch_size_multiple=8),
    dict(max_tokens=None, max_sentences=64, required_batch_size_multiple=8),
    dict(max_tokens=100, max_sentences=None, required_batch_size_multiple=8),
    dict(max_tokens=150, max_sentences=7, required_batch_size_multiple=1),
    dict(max_tokens=None, max_sentences=None, required_batch_size_multiple=3),
]


def _sizes(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(1, 30, n).astype(np.int64)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n", [1, 7, 100, 257])
def test_every_sentence_is_batched_exactly_once(cfg, n):
    sizes = _sizes(n, n)
    indices = np.argsort(sizes, kind="mergesort")
    batches = batch_by_size(indices, sizes[indices], **cfg)
    assert sorted(np.concatenate(batches).tolist()) == list(range(n))
    mult = cfg["required_batch_size_multiple"]
    for batch in batches:
        assert len(batch) > 0
        if cfg["max_sentences"]:
            assert len(batch) <= cfg["max_sentences"]
        if cfg["max_tokens"]:
            assert sizes[batch].max() * len(batch) <= cfg["max_tokens"]
    # Only the final batch, or one cut from a batch smaller than the multiple, may be ragged.
    ragged = [len(b) for b in batches[:-1] if len(b) % mult]
    assert all(size < mult for size in ragged)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_same_batches_as_fairseq_plus_what_fairseq_drops(cfg):
    sizes = _sizes(100, 0)
    indices = np.arange(100)
    ours = batch_by_size(indices, sizes, **cfg)
    theirs = data_utils.batch_by_size(
        indices, lambda i: sizes[i], num_tokens_vec=sizes, **cfg
    )
    # fairseq's greedy choices are the reference; what it loses is the end of the last batch
    # (cut to the batch multiple) or the whole last batch.
    ours, theirs = [b.tolist() for b in ours], [list(map(int, b)) for b in theirs]
    assert len(ours) - len(theirs) in (0, 1)
    assert ours[: len(theirs) - 1] == theirs[:-1]
    last = theirs[-1]
    assert ours[len(theirs) - 1][: len(last)] == last
    assert sum(map(len, ours)) == 100


def test_sentence_longer_than_max_tokens_is_an_error_naming_it():
    sizes = np.array([3, 50, 4])
    with pytest.raises(ValueError, match="sentence 1 has 50 tokens"):
        batch_by_size(np.arange(3), sizes, max_tokens=20)

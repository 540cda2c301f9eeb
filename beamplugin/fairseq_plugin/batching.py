"""Batching that never loses a sentence.

fairseq's compiled ``batch_by_size`` in the Python 3.11 rebuilds drops the last, partial batch
(100 sentences with ``--required-batch-size-multiple 8`` come back as 96, silently). This is
the same greedy policy written plainly, followed by a check that every index is batched once.
"""

from __future__ import annotations

import numpy as np
from fairseq.data import BaseWrapperDataset


def batch_by_size(
    indices: np.ndarray,
    num_tokens: np.ndarray,
    max_tokens: int | None = None,
    max_sentences: int | None = None,
    required_batch_size_multiple: int = 1,
) -> list[np.ndarray]:
    """Split ``indices`` (in order) into batches, as fairseq's greedy batcher intends.

    ``num_tokens[i]`` is the size of the i-th entry of ``indices``. A batch is closed when one
    more sentence would exceed ``max_sentences`` or make ``longest * count`` exceed
    ``max_tokens``; a closed batch is cut down to a multiple of ``required_batch_size_multiple``
    when that is possible, the rest starting the next batch. The last batch keeps whatever is
    left, so the result always covers every index exactly once.
    """
    indices = np.asarray(indices, dtype=np.int64)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    if len(num_tokens) != len(indices):
        raise ValueError("num_tokens must give one size per index")
    max_tokens = max_tokens or np.iinfo(np.int64).max
    max_sentences = max_sentences or np.iinfo(np.int64).max
    mult = max(1, required_batch_size_multiple)

    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, size in enumerate(num_tokens.tolist()):
        if size > max_tokens:
            raise ValueError(
                f"sentence {indices[pos]} has {size} tokens, more than --max-tokens {max_tokens}"
            )
        count = pos - start
        grown = max(longest, size)
        if count > 0 and (count + 1 > max_sentences or grown * (count + 1) > max_tokens):
            keep = max(mult * (count // mult), count % mult)
            batches.append(indices[start : start + keep])
            start += keep
            longest = int(num_tokens[start : pos + 1].max())
        else:
            longest = grown
    if start < len(indices):
        batches.append(indices[start:])

    batched = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
    if len(batched) != len(indices) or not np.array_equal(np.sort(batched), np.sort(indices)):
        raise AssertionError("batching lost or repeated a sentence")  # a bug here, never input
    return batches


class LosslessBatchingDataset(BaseWrapperDataset):
    """Wraps a dataset so that fairseq's batch iterators batch it with ``batch_by_size`` above."""

    def batch_by_size(
        self,
        indices: np.ndarray,
        max_tokens: int | None = None,
        max_sentences: int | None = None,
        required_batch_size_multiple: int = 1,
    ) -> list[np.ndarray]:
        return batch_by_size(
            indices,
            self._num_tokens(indices),
            max_tokens,
            max_sentences,
            required_batch_size_multiple,
        )

    def _num_tokens(self, indices: np.ndarray) -> np.ndarray:
        try:
            return self.dataset.num_tokens_vec(indices)
        except NotImplementedError:  # as fairseq's batch_by_size falls back (ConcatDataset)
            return np.array([self.dataset.num_tokens(i) for i in indices], dtype=np.int64)

"""A vocabulary shortlist: the target tokens a sentence may produce, from the n-grams of its
source (CTranslate2's vocabulary map, ``use_vmap``).

The map is a text file, one rule a line, ``<source n-gram>\\t<target token> <target token> ...``
(CTranslate2's format: the same files serve both). A line with an empty n-gram lists tokens
every sentence may produce. A sentence's shortlist is those, the targets of every n-gram of its
source, its forced prefix, and the special tokens its caller adds (our tasks: fairseq's four).
The search then normalises each step's probabilities over the shortlist alone and never picks a
token outside it: results differ from a search over the whole vocabulary (docs/fairseq.md,
"Vocabulary shortlists").
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class VocabularyMap:
    """Source n-grams (token ids) to the target token ids they bring into a shortlist.

    A map of a 256k-word vocabulary lists millions of target tokens, and looking each up in the
    dictionary at random takes most of a microsecond (a cache miss or more): the file stays
    mapped and only the n-grams that really occur in a source have their targets looked up, once
    (:meth:`read` finds each line's n-gram and where its targets are)."""

    def __init__(
        self,
        path: Path,
        rules: dict[tuple[int, ...], tuple[int, ...]],
        target: Mapping[str, int],
        always: Iterable[int],
        source: Mapping[str, int],
    ) -> None:
        self.path, self.rules, self.target, self.source = path, rules, target, source
        self.always = np.unique(np.fromiter(always, np.int64))
        self.longest = max((len(key) for key in rules), default=0)
        with open(path, "rb") as f:
            self.text = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if rules else b""
        self._targets: dict[tuple[int, ...], np.ndarray] = {}

    @classmethod
    def read(
        cls,
        path: str | Path,
        source: Mapping[str, int],
        target: Mapping[str, int],
        always: Iterable[int] = (),
    ) -> VocabularyMap:
        """The map in file ``path``, its tokens looked up in ``source`` and ``target`` (a fairseq
        dictionary's ``indices``), ``always`` added to every shortlist. A rule whose n-gram has
        a token the source dictionary lacks can never match and is left out (the log says how
        many); so are target tokens the target dictionary lacks."""
        path = Path(path)
        # per n-gram, where its targets are in the file: (start, stop, start, stop ...), for an
        # n-gram on several lines
        rules: dict[tuple[int, ...], tuple[int, ...]] = {}
        fixed, unmatched, offset = list(always), 0, 0
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                start, offset = offset, offset + len(line)
                ngram, tab, targets = line.partition(b"\t")
                if not tab:
                    if not line.strip():
                        continue
                    raise ValueError(f"{path}, line {number}: expected '<source n-gram>\\t<target "
                                     f"tokens>', found no tab")  # fmt: skip
                words = _decoded(ngram, path, number).split()
                if not words:
                    fixed.extend(_ids(_decoded(targets, path, number), target))
                    continue
                key = tuple(source.get(word, -1) for word in words)
                if -1 in key:
                    unmatched += 1
                    continue
                first = start + len(ngram) + 1
                rules[key] = (*rules.get(key, ()), first, start + len(line))
        if unmatched:
            logger.warning("vocabulary map %s: %d rules whose source n-gram is not in the source "
                           "dictionary left out", path, unmatched)  # fmt: skip
        return cls(path, rules, target, fixed, source)

    def shortlist(self, source: Iterable[int], prefix: Iterable[int] = ()) -> Tensor:
        """The sorted target ids a sentence of ``source`` ids may produce (``prefix``: its
        forced tokens, which it must be able to)."""
        source = list(source)
        parts = [self.always, np.fromiter(prefix, np.int64)]
        for n in range(1, self.longest + 1):
            for start in range(len(source) - n + 1):
                key = tuple(source[start : start + n])
                if key in self.rules:
                    parts.append(self._targets_of(key))
        return torch.from_numpy(np.unique(np.concatenate(parts)))

    def _targets_of(self, key: tuple[int, ...]) -> np.ndarray:
        ids = self._targets.get(key)
        if ids is None:
            ranges = self.rules[key]
            text = b" ".join(self.text[ranges[i] : ranges[i + 1]] for i in range(0, len(ranges), 2))
            ids = self._targets[key] = np.array(_ids(text.decode("utf-8"), self.target), np.int64)
        return ids

    def __reduce__(self) -> tuple[Any, ...]:
        # a mapped file is not pickled: the copy maps it again (a decoder process, a Ray actor)
        return (VocabularyMap.read, (self.path, self.source, self.target, self.always.tolist()))


def _ids(text: str, target: Mapping[str, int]) -> list[int]:
    """The ids of the target tokens of ``text`` (those the dictionary lacks left out)."""
    return [i for i in (target.get(token, -1) for token in text.split()) if i != -1]


def _decoded(part: bytes, path: Path, number: int) -> str:
    try:
        return part.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}, line {number}: not UTF-8 ({error})") from None

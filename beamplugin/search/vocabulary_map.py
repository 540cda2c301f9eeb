"""A vocabulary shortlist: the target tokens a sentence may produce, from the n-grams of its
source (CTranslate2's vocabulary map, ``use_vmap``).

The map is a text file, one rule a line, ``<source n-gram>\t<target token> <target token> ...``
(CTranslate2's format: the same files serve both). A line with an empty n-gram lists tokens
every sentence may produce. A sentence's shortlist is those, the targets of every n-gram of its
source, its forced prefix, and the special tokens its caller adds (our tasks: fairseq's four).
The search then normalises each step's probabilities over the shortlist alone and never picks a
token outside it: results differ from a search over the whole vocabulary (docs/fairseq.md,
"Vocabulary shortlists").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class VocabularyMap:
    """Source n-grams (token ids) to the target token ids they bring into a shortlist."""

    def __init__(
        self, rules: Mapping[tuple[int, ...], Iterable[int]], always: Iterable[int]
    ) -> None:
        self.rules = {key: np.unique(np.fromiter(ids, np.int64)) for key, ids in rules.items()}
        self.always = np.unique(np.fromiter(always, np.int64))
        self.longest = max((len(key) for key in self.rules), default=0)

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
        a token the source dictionary lacks can never match and is left out; so are target
        tokens the target dictionary lacks (the log says how many)."""
        rules: dict[tuple[int, ...], list[int]] = {}
        fixed, unmatched, unknown = list(always), 0, set()
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if "\t" not in line:
                    raise ValueError(f"{path}, line {number}: expected '<source n-gram>\\t<target "
                                     f"tokens>', found no tab")  # fmt: skip
                ngram, targets = line.split("\t", 1)
                ids = []
                for token in targets.split():
                    if token in target:
                        ids.append(target[token])
                    else:
                        unknown.add(token)
                if not ngram.strip():
                    fixed.extend(ids)
                    continue
                tokens = ngram.split()
                if not all(token in source for token in tokens):
                    unmatched += 1
                    continue
                rules.setdefault(tuple(source[token] for token in tokens), []).extend(ids)
        if unmatched or unknown:
            logger.warning(
                "vocabulary map %s: %d rules whose source n-gram is not in the source dictionary "
                "and %d target tokens not in the target dictionary left out",
                path, unmatched, len(unknown),
            )  # fmt: skip
        return cls(rules, fixed)

    def shortlist(self, source: Iterable[int], prefix: Iterable[int] = ()) -> Tensor:
        """The sorted target ids a sentence of ``source`` ids may produce (``prefix``: its
        forced tokens, which it must be able to)."""
        source = list(source)
        parts = [self.always, np.fromiter(prefix, np.int64)]
        for n in range(1, self.longest + 1):
            for start in range(len(source) - n + 1):
                ids = self.rules.get(tuple(source[start : start + n]))
                if ids is not None:
                    parts.append(ids)
        return torch.from_numpy(np.unique(np.concatenate(parts)))

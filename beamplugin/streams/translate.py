"""An iterable of sentences decoded as one stream in the caller's thread: each result as soon
as it is finished (completion order) or in input order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from beamplugin.engine.choice import engine_for
from beamplugin.engine.engine import Decoder
from beamplugin.engine.requests import Request
from beamplugin.search.constraints import Constraints
from beamplugin.search.nbest import Hypothesis
from beamplugin.streams.run import IteratorSource, run, sentence_request


def translate(
    generator: Decoder,
    sentences: Iterable[Tensor | tuple[Tensor, Constraints | None]],
    max_sentences: int | None = 64,
    max_tokens: int | None = None,
    ordered: bool = False,
) -> Iterator[tuple[int, list[Hypothesis] | Exception]]:
    """Decode ``sentences`` (1-D token tensors ending in EOS, or such a tensor with the
    sentence's constraints: token sequences its hypotheses must contain, met as the generator's
    ``--constraints`` says) as one stream, with at most ``max_sentences`` sentences /
    ``max_tokens`` tokens (beam x source length) in flight.

    Yields ``(index, hypotheses best first)``, or ``(index, error)`` for a sentence that cannot
    be decoded, as soon as each is finished; ``ordered``: in input order instead.
    """
    engine = engine_for(generator, max_sentences, max_tokens)
    requests = (_request(i, sentence) for i, sentence in enumerate(sentences))
    with torch.inference_mode():
        results = ((f.key, f.error or f.hypotheses) for f in run(engine, IteratorSource(requests)))
        if not ordered:
            yield from results
            return
        waiting: dict[int, Any] = {}
        next_index = 0
        for index, result in results:
            waiting[index] = result
            while next_index in waiting:
                yield next_index, waiting.pop(next_index)
                next_index += 1


def _request(index: int, sentence: Tensor | tuple[Tensor, Constraints | None]) -> Request:
    """The request of the ``index``-th sentence, its constraints with it if it has any."""
    if isinstance(sentence, tuple):
        tokens, constraints = sentence
        return sentence_request(index, tokens, None, constraints=constraints)
    return sentence_request(index, sentence, None)

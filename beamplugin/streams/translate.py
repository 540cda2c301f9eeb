"""An iterable of sentences decoded as one stream in the caller's thread: each result as soon
as it is finished (completion order) or in input order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from beamplugin.engine.choice import engine_for
from beamplugin.engine.engine import Decoder
from beamplugin.search.nbest import Hypothesis
from beamplugin.streams.run import IteratorSource, run, sentence_request


def translate(
    generator: Decoder,
    sentences: Iterable[Tensor],
    max_sentences: int | None = 64,
    max_tokens: int | None = None,
    ordered: bool = False,
) -> Iterator[tuple[int, list[Hypothesis] | Exception]]:
    """Decode ``sentences`` (1-D token tensors ending in EOS) as one stream, with at most
    ``max_sentences`` sentences / ``max_tokens`` tokens (beam x source length) in flight.

    Yields ``(index, hypotheses best first)``, or ``(index, error)`` for a sentence that cannot
    be decoded, as soon as each is finished; ``ordered``: in input order instead.
    """
    engine = engine_for(generator, max_sentences, max_tokens)
    requests = (sentence_request(i, tokens, None) for i, tokens in enumerate(sentences))
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

"""What goes into an engine and what comes out: requests of sentences, finished sentences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from beamplugin.search.constraints import Constraints
from beamplugin.search.nbest import Hypothesis
from beamplugin.search.options import DecodingOptions


@dataclass
class Request:
    """Sentences admitted together.

    Limits that depend on the source are computed per request, as fairseq computes them per
    batch: ``max_len_a`` multiplies the request's (padded) width, ``match_source_len`` takes its
    longest source. A request of one sentence gets limits from that sentence alone.
    """

    keys: list[Any]  # one per sentence: what its Finished result carries back
    src_tokens: Tensor  # [sentences, width], left-padded, each row ending in EOS
    # [sentences] as fairseq's collater counts them (EOS included); if None, as fairseq's
    # generator then counts them (without EOS)
    src_lengths: Tensor | None = None
    prefix_tokens: Tensor | None = None  # [sentences, p] forced first tokens, pad: free choice
    # what the hypotheses start from (a target-language token of a multilingual model trained
    # with --lang-tok-replacing-bos-eos); None: the engine's (EOS, as in fairseq)
    bos: int | None = None
    # one per sentence: the token sequences its hypotheses must contain (the options'
    # ``constraints`` say ordered or not); None, or a sentence's empty list: none
    constraints: list[Constraints] | None = None
    max_len: int = -1  # output tokens before EOS is forced: set by Scheduler.check

    @property
    def width(self) -> int:
        return self.src_tokens.size(1)

    def source_lengths(self, options: DecodingOptions) -> Tensor:
        """The source lengths, or what fairseq's generator counts without them: the tokens but
        EOS and padding."""
        if self.src_lengths is not None:
            return self.src_lengths
        tokens = self.src_tokens
        return (tokens.ne(options.eos) & tokens.ne(options.pad)).long().sum(1)


class Finished(NamedTuple):
    """A sentence's hypotheses, best first, or why it could not be decoded."""

    key: Any
    hypotheses: list[Hypothesis]
    error: Exception | None = None

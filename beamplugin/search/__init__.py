"""The search, as pure pieces testable without a model or an engine: the beam step, the n-best
keeper, the exact stopping bound, fairseq's log-prob rules, and the options they all read."""

from beamplugin.search.beam_step import (
    BeamStep,
    beam_step,
    block_repeated_ngrams,
    concat_steps,
    length_normaliser,
    step_laid_out,
)
from beamplugin.search.options import DecodingOptions

__all__ = [
    "BeamStep",
    "DecodingOptions",
    "beam_step",
    "block_repeated_ngrams",
    "concat_steps",
    "length_normaliser",
    "step_laid_out",
]

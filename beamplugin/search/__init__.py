"""Pure tensor pieces of beam search, unit-testable without a model."""

from beamplugin.search.beam_step import (
    BeamStep,
    beam_step,
    block_repeated_ngrams,
    concat_steps,
    length_normaliser,
)

__all__ = ["BeamStep", "beam_step", "concat_steps", "block_repeated_ngrams", "length_normaliser"]

"""The fairseq-facing parts: our SequenceGenerator, the beam_translation task, its batching and
input lines, fairseq-generate's continuous batching, checkpoints and reduced precision."""

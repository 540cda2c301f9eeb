"""Streams of sentences on one engine: whenever sentences finish, the next ones are admitted
into the freed capacity, mid-search (continuous batching)."""

from beamplugin.streams.run import IteratorSource, Source, run, sentence_request
from beamplugin.streams.translate import translate
from beamplugin.streams.translation_stream import (
    QueueFull,
    StreamClosed,
    StreamFailed,
    TranslationStream,
)

__all__ = [
    "IteratorSource",
    "QueueFull",
    "Source",
    "StreamClosed",
    "StreamFailed",
    "TranslationStream",
    "run",
    "sentence_request",
    "translate",
]

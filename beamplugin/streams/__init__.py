"""Streams of sentences on one engine: whenever sentences finish, the next ones are admitted
into the freed capacity, mid-search (continuous batching)."""

from beamplugin.streams.run import (
    IteratorSource,
    Observer,
    Prompt,
    Source,
    run,
    sentence_request,
)
from beamplugin.streams.translate import translate
from beamplugin.streams.translation_stream import (
    QueueFull,
    StreamClosed,
    StreamFailed,
    StreamObserver,
    TranslationStream,
)

__all__ = [
    "IteratorSource",
    "Observer",
    "Prompt",
    "QueueFull",
    "Source",
    "StreamClosed",
    "StreamFailed",
    "StreamObserver",
    "TranslationStream",
    "run",
    "sentence_request",
    "translate",
]

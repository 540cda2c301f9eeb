"""What crosses the pipe between the server and its decoder process
(beamplugin.serving.decoder_process), one named type per message, so that each end reads fields
by name rather than by position. Tensors cross as numpy arrays: pickled as bytes, where torch
would pass tensors through shared memory files.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from beamplugin.search.constraints import Constraints
from beamplugin.serving.loading import DecoderSettings

# The parent to the child


class Sentence(NamedTuple):
    """One sentence of a :class:`Submit`, under the parent's key for its future."""

    key: int
    tokens: np.ndarray
    constraints: Constraints | None


class Submit(NamedTuple):
    """Sentences to decode, all with the same prompt (``prefix`` and ``bos``, as
    :class:`~beamplugin.streams.Prompt` has them)."""

    sentences: list[Sentence]
    prefix: np.ndarray | None
    bos: int | None


class Cancel(NamedTuple):
    """The sentences of these keys are not wanted any more."""

    keys: list[int]


class Close(NamedTuple):
    """Take no more sentences; finish those accepted, then answer :class:`Closed`."""


# The child to the parent


class Ready(NamedTuple):
    """The models are loaded, with these settings: the child's first message, or
    :class:`StartFailed`."""

    settings: DecoderSettings


class StartFailed(NamedTuple):
    """The models did not load; the parent raises ``error``."""

    error: BaseException


class Done(NamedTuple):
    """A sentence's hypotheses, best first (tensors as numpy arrays), and the sentences in
    flight after it."""

    key: int
    hypotheses: list[dict[str, Any]]
    in_flight: int


class Error(NamedTuple):
    """A sentence failed with ``error``; ``failed``: the decoder itself has failed, and fails
    everything from now on."""

    key: int
    error: BaseException
    in_flight: int
    failed: bool


class Cancelled(NamedTuple):
    """A sentence was cancelled, as :class:`Cancel` asked."""

    key: int
    in_flight: int


class Stats(NamedTuple):
    """The steps since the last report (``(sentences, seconds)`` each), the queue waits in
    seconds, and the sentences in flight after them."""

    steps: list[tuple[int, float]]
    waits: list[float]
    in_flight: int


class Closed(NamedTuple):
    """Every accepted sentence has been answered; the child exits."""


ToChild = Submit | Cancel | Close
FromChild = Ready | StartFailed | Done | Error | Cancelled | Stats | Closed
Answer = Done | Error | Cancelled  # of one sentence

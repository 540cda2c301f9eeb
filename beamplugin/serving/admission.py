"""Taking a request's lines into the translator: the checks that turn it away whole (the
server stopping, too many sentences, the character limit, a line that cannot be encoded, no room
in the queue, a decoder restarting or failed), then the wait for every sentence, bounded by the
request timeout; whatever ends the wait early cancels the request's sentences still in flight."""

from __future__ import annotations

import asyncio

from beamplugin.fairseq_plugin.language_pairs import Pair
from beamplugin.search.constraints import Constraints
from beamplugin.serving.decoder_process import DecoderRestarting
from beamplugin.serving.guards import Guards
from beamplugin.serving.metrics import ServerMetrics
from beamplugin.serving.responses import Refused
from beamplugin.serving.translator import RefusedSentence, Translation, Translator
from beamplugin.streams import QueueFull, StreamClosed, StreamFailed

RETRY_AFTER_SECONDS = 1


class Admission:
    """Requests' lines into ``translator`` and their translations back, rendered and counted
    in ``metrics``; ``stopping`` set, every new request is refused (503)."""

    def __init__(
        self,
        translator: Translator,
        guards: Guards,
        metrics: ServerMetrics,
        max_sentences: int,
        request_timeout: float | None,
    ) -> None:
        self.translator, self.guards, self.metrics = translator, guards, metrics
        self.max_sentences, self.request_timeout = max_sentences, request_timeout
        self.stopping = False

    async def translate(
        self,
        lines: list[str],
        nbest: int,
        pair: Pair,
        constraints: list[Constraints | None] | None = None,
    ) -> list[list[Translation]]:
        """The ``nbest`` best translations of each line in ``pair``, each holding its line's
        ``constraints`` (if any), in order; Refused if the request cannot be taken (nothing of
        it is then queued) or is not answered in time (its sentences are then cancelled, as
        they are when the client goes away)."""
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        stopping = Refused(503, "the server is stopping", retry, reason="stopping")
        if self.stopping:
            raise stopping
        if not 1 <= len(lines) <= self.max_sentences:
            raise Refused(400, f"{len(lines)} sentences: a request has 1 to {self.max_sentences}")
        self.guards.check_characters(lines)
        try:
            sources = self.translator.encode(lines, pair)
        except RefusedSentence as refusal:
            raise Refused(400, str(refusal)) from None
        try:
            futures = self.translator.submit(sources, pair, constraints)
        except QueueFull:
            raise Refused(
                503,
                f"the server is busy: no room for {len(lines)} more sentence(s), retry later",
                retry,
                reason="queue_full",
            ) from None
        except DecoderRestarting as restarting:
            raise Refused(503, f"{restarting}, retry later", retry, reason="restarting") from None
        except StreamFailed as failed:  # the model failed earlier: every request is told
            raise Refused(500, str(failed)) from None
        except StreamClosed:
            raise stopping from None
        try:
            async with asyncio.timeout(self.request_timeout):
                results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except TimeoutError:
            raise Refused(
                504,
                f"not translated within the request timeout of {self.request_timeout:g} s",
                reason="timeout",
            ) from None
        except ValueError as error:
            if constraints is None:
                raise
            # the engine refuses a sentence whose constraints cannot fit in, or were not met
            # within, its maximum output length (that sentence alone)
            raise Refused(400, f"the glossary cannot be met: {error}") from None
        finally:  # whatever ended the wait early (timeout, client gone, a failed sentence)
            for future in futures:
                future.cancel()  # a sentence already answered stays answered
        translations = []
        for source, hypotheses in zip(sources, results, strict=True):
            rendered = self.translator.render(source, hypotheses[:nbest], pair)
            translations.append(rendered)
            self.metrics.sentences.inc()
            self.metrics.source_tokens.inc(len(source))
            self.metrics.target_tokens.inc(rendered[0].tokens)
        return translations

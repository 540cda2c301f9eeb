"""Taking a request's lines into the translator: the checks that turn it away whole (the
server stopping, too many sentences, the character limit, a line that cannot be encoded, no room
in the queue, a decoder restarting or failed), then the wait for every sentence, bounded by the
request timeout; whatever ends the wait early cancels the request's sentences still in flight.

Documents count as what the client sent (a text, a file), not as the sentences they are cut
into: a 200-paragraph document is one text. Their sentences go to the engine in windows of half
--max-request-sentences, two windows at a time, so that a document never holds more of the
queue than a request of the most sentences, and the next window fills the engine while one
finishes; its size is bounded by --char-limit and --max-body-bytes."""

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
WINDOWS_AT_ONCE = 2


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
        documents: int | None = None,
    ) -> list[list[Translation]]:
        """The ``nbest`` best translations of each line in ``pair``, each holding its line's
        ``constraints`` (if any), in order; Refused if the request cannot be taken (nothing of
        it is then queued) or is not answered in time (its sentences are then cancelled, as
        they are when the client goes away). With ``documents``, ``lines`` are the sentences
        of that many documents: the documents count against the limit, and the sentences go
        in windows."""
        if self.stopping:
            raise self._stopping()
        counted, what = (len(lines), "sentences") if documents is None else (documents, "texts")
        if not 1 <= counted <= self.max_sentences:
            raise Refused(400, f"{counted} {what}: a request has 1 to {self.max_sentences}")
        self.guards.check_characters(lines)
        size = len(lines) if documents is None else max(1, self.max_sentences // WINDOWS_AT_ONCE)
        windows = [range(start, min(start + size, len(lines)))
                   for start in range(0, len(lines), size)]  # fmt: skip
        gate = asyncio.Semaphore(WINDOWS_AT_ONCE)

        async def window(numbers: range) -> list[list[Translation]]:
            async with gate:
                mine = None if constraints is None else [constraints[i] for i in numbers]
                return await self._translate([lines[i] for i in numbers], nbest, pair, mine)

        tasks = [asyncio.ensure_future(window(numbers)) for numbers in windows]
        try:
            async with asyncio.timeout(self.request_timeout):
                parts = await asyncio.gather(*tasks)
        except TimeoutError:
            raise Refused(
                504,
                f"not translated within the request timeout of {self.request_timeout:g} s",
                reason="timeout",
            ) from None
        finally:  # a window refused, a timeout, the client gone: the others are cancelled
            for task in tasks:
                task.cancel()
        return [translations for part in parts for translations in part]

    def _stopping(self) -> Refused:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return Refused(503, "the server is stopping", retry, reason="stopping")

    async def _translate(
        self, lines: list[str], nbest: int, pair: Pair, constraints: list[Constraints | None] | None
    ) -> list[list[Translation]]:
        """``lines`` encoded, queued and waited for (cancelled if the wait ends early)."""
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
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
            raise self._stopping() from None
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
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

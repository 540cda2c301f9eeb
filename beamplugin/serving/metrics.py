"""The translation server's Prometheus metrics, in a registry of their own (one per server),
named as serving engines name theirs: sentences waiting and in flight, cancelled, requests
rejected by reason, the decoder's step time and sentences per step, queue wait time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# Request latency buckets (seconds): from a short sentence alone to a full queue on a CPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
# A decoder step: a few sentences on a GPU to a full batch of long ones on a CPU.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
SENTENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Decoding(Protocol):
    """What the metrics read of the decoding side (a Translator) when scraped."""

    @property
    def queued(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def cancelled(self) -> int: ...

    @property
    def restarts(self) -> int: ...


class ServerMetrics:
    """Gauges and the decoding side's own counts are read when scraped; the rest is counted by
    the server as it answers, and by the decoder (as the stream's observer) as it steps."""

    def __init__(self, decoding: Decoding) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "beamplugin_queue_depth",
            "Sentences accepted and waiting for room in the decoding engine",
            registry=self.registry,
        ).set_function(lambda: decoding.queued)
        Gauge(
            "beamplugin_sentences_in_flight",
            "Sentences being decoded (in the engine's beam search)",
            registry=self.registry,
        ).set_function(lambda: decoding.in_flight)
        self.registry.register(_DecodingCounts(decoding))
        self.sentences = Counter(
            "beamplugin_sentences_translated",
            "Sentences translated and answered",
            registry=self.registry,
        )
        self.source_tokens = Counter(
            "beamplugin_source_tokens",
            "Source tokens of the sentences translated (end of sentence included)",
            registry=self.registry,
        )
        self.target_tokens = Counter(
            "beamplugin_target_tokens",
            "Tokens of the best translations (end of sentence included)",
            registry=self.registry,
        )
        self.requests = Counter(
            "beamplugin_requests",
            "HTTP requests answered, by endpoint and status (499: the client went away)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "beamplugin_requests_rejected",
            "Translation requests turned away, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "beamplugin_request_latency_seconds",
            "Time from a translation request's arrival to its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "beamplugin_step_seconds",
            "Time of one decoder step (a forward and a beam search step of every sentence)",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.step_sentences = Histogram(
            "beamplugin_step_sentences",
            "Sentences decoded together in one decoder step",
            buckets=SENTENCE_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "beamplugin_queue_wait_seconds",
            "Time from a sentence's submission to the decoder to its first step",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def stepped(self, sentences: int, seconds: float) -> None:
        """A decoder step (the stream's observer)."""
        self.step_seconds.observe(seconds)
        self.step_sentences.observe(sentences)

    def waited(self, seconds: list[float]) -> None:
        """Sentences put in flight (the stream's observer)."""
        for wait in seconds:
            self.queue_wait.observe(wait)

    def exposition(self) -> bytes:
        """Everything, in Prometheus' text format."""
        return generate_latest(self.registry)


class _DecodingCounts(Collector):
    """Counters the decoding side keeps itself, read when scraped."""

    def __init__(self, decoding: Decoding) -> None:
        self._decoding = decoding

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "beamplugin_sentences_cancelled",
            "Sentences cancelled before they were answered (client gone, or request timed out)",
            value=self._decoding.cancelled,
        )
        yield CounterMetricFamily(
            "beamplugin_decoder_restarts",
            "Decoder processes started to replace one that died",
            value=self._decoding.restarts,
        )

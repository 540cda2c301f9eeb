"""The translation server's Prometheus metrics, in a registry of their own (one per server)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Request latency buckets (seconds): from a short sentence alone to a full queue on a CPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)


class Decoding(Protocol):
    """What the metrics read of the decoding side (a TranslationStream or a DecoderProcess)."""

    @property
    def queued(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


class ServerMetrics:
    """Queue depth and sentences in flight are read from the stream when scraped; the rest is
    counted by the server as it answers."""

    def __init__(self, stream: Decoding) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "beamplugin_queue_depth",
            "Sentences accepted and waiting for room in the decoding engine",
            registry=self.registry,
        ).set_function(lambda: stream.queued)
        Gauge(
            "beamplugin_sentences_in_flight",
            "Sentences being decoded (in the engine's beam search)",
            registry=self.registry,
        ).set_function(lambda: stream.in_flight)
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
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "beamplugin_request_latency_seconds",
            "Time from a translation request's arrival to its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """Everything, in Prometheus' text format."""
        return generate_latest(self.registry)

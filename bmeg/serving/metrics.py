"""Prometheus metrics of the server, in a registry of their own (one per app, so tests can build many).

Labels are bounded: `service` is one of the model's services (its training vocabulary) or
`other`, since service names come from spans, which anyone who can send a trace writes (60,000
invented names made a 25 MB `/metrics` page); `route` is a route template or `<unmatched>`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from collections.abc import Iterable

from bmeg.diagnosis import Diagnosis

#: The `service` label of every service the model does not know.
OTHER = "other"
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("bmeg_http_requests", "HTTP requests by route, method and status.",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("bmeg_http_request_seconds", "HTTP request latency by route.", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.traces = Counter("bmeg_traces_diagnosed", "Traces diagnosed.", registry=self.registry)
        self.spans = Counter("bmeg_spans_diagnosed", "Spans in the traces diagnosed.", registry=self.registry)
        self.anomalies = Counter("bmeg_anomalous_traces", "Traces diagnosed as anomalous.", registry=self.registry)
        self.bottlenecks = Counter("bmeg_bottlenecks", "Bottleneck services reported, by service.", ["service"],
                                   registry=self.registry)
        self.model = Info("bmeg_model", "The model in use.", registry=self.registry)
        self.model_loaded = Gauge("bmeg_model_loaded", "1 when a model is loaded and ready.", registry=self.registry)
        self.services: frozenset[str] = frozenset()

    def know_services(self, services: Iterable[str]) -> None:
        """The services that get a label of their own (the model's); the rest count as `other`."""
        self.services = frozenset(services) - {OTHER}

    def count_diagnosis(self, diagnosis: Diagnosis) -> None:
        self.traces.inc(len(diagnosis.traces))
        self.spans.inc(sum(trace.spans for trace in diagnosis.traces))
        self.anomalies.inc(len(diagnosis.anomalous))
        for trace in diagnosis.anomalous:
            for score in trace.bottlenecks:
                if score.bottleneck:
                    self.bottlenecks.labels(score.service if score.service in self.services else OTHER).inc()

"""Spans pushed over OTLP/HTTP (`POST /v1/traces`) to diagnoses on Kafka: the consumer's pipeline
without Kafka on the way in.

A request's spans are `offer`ed to a bounded queue and answered at once (OTLP's contract: the
sender learns the spans were accepted, not diagnosed). One worker thread takes them in arrival
order into the same `TraceAssembler` as `bmeg consume` (a trace is complete when its root and
every expected span are in, else after the idle timeout: the senders' 5 s export schedule),
diagnoses finished traces in batches with the server's model (one call at a time, shared with
`POST /diagnose`) through `diagnose_batch`, and publishes them with the consumer's `Publisher`:
the diagnosis with its hints and start time, forwards to mitigation for whole anomalous traces,
dead letters for traces the model rejects, retries while the broker is away.

Backpressure instead of loss: spans held (queued, being assembled, diagnosed but not yet
acknowledged by the broker) are bounded by `max_held_spans`; beyond it `offer` refuses and the
endpoint answers 429 with Retry-After, which OTLP senders (the SDKs' exporters, the Collector's
`otlphttp`) retry. A publish that fails for good (`PublishError`) stops the worker: `failed`
says why and the endpoint answers 503. There is no offset to hold back, so spans accepted and
not yet published are lost if the process dies (as in any OTLP receiver that answers before
exporting); a graceful stop publishes them, waiting for the broker at most `shutdown_timeout_s`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import pyarrow as pa
from kafka.errors import KafkaError
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bmeg.serving.assembler import DEFAULT_IDLE_TIMEOUT_S, PendingTrace, TraceAssembler
from bmeg.serving.publishing import Delivery, Publisher, PublishError, Topics, diagnose_batch, make_producer

log = logging.getLogger(__name__)

Diagnose = Callable[[Callable[[Any], Any]], Any]  # runs a function with the model in use


class IngestSettings(BaseSettings):
    """`POST /v1/traces`, from the environment (`BMEG_OTLP_*`); off unless `BMEG_OTLP_BOOTSTRAP` is set."""

    model_config = SettingsConfigDict(env_prefix="BMEG_OTLP_", extra="ignore")

    bootstrap: str | None = Field(default=None, description="Kafka bootstrap servers the diagnoses are published to.")
    diagnoses_topic: str = "bmeg.diagnoses"
    mitigations_topic: str = "bmeg.mitigations"
    dead_letter_topic: str = "otlp_spans.dlq"
    idle_timeout_s: float = Field(default=DEFAULT_IDLE_TIMEOUT_S, gt=0, description="As `bmeg consume --idle-timeout`.")
    max_trace_spans: int = Field(default=10_000, gt=0)
    batch_traces: int = Field(default=512, gt=0, description="Traces diagnosed per model call.")
    max_held_spans: int = Field(default=200_000, gt=0, description="Spans held before requests are refused (429).")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After of a refused request.")
    shutdown_timeout_s: float = Field(default=20.0, ge=0)


class OtlpIngest:
    def __init__(self, settings: IngestSettings, with_model: Diagnose, producer: Callable | None = None):
        if settings.bootstrap is None:
            raise ValueError("POST /v1/traces publishes to Kafka: set BMEG_OTLP_BOOTSTRAP")
        self.settings = settings
        self.with_model = with_model
        self.assembler = TraceAssembler(settings.idle_timeout_s, settings.max_trace_spans)
        self._producer = producer or partial(make_producer, settings.bootstrap)
        self.publisher: Publisher | None = None  # made by the worker: the broker may be away at start
        self.failed: str | None = None
        self._queue: deque[pa.Table] = deque()
        self._lock = threading.Lock()
        self._held = 0  # spans queued, assembling or awaiting the broker
        self._unsent: list[tuple[Delivery, int]] = []  # (delivery, its trace's spans)
        self._requests = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bmeg-otlp-ingest", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, spans: pa.Table) -> bool:
        """Queue a request's spans; False when that would hold more than `max_held_spans`."""
        with self._lock:
            if self._held + spans.num_rows > self.settings.max_held_spans and self._held > 0:
                return False
            self._held += spans.num_rows
            self._queue.append(spans)
        self._wake.set()
        return True

    @property
    def held_spans(self) -> int:
        return self._held

    def stop(self) -> None:
        """Publish every trace held, wait for the broker's acknowledgements (bounded), close."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self.settings.shutdown_timeout_s + 5)
        if self._thread.is_alive():
            log.error("the ingest worker did not stop in time: %d spans held are lost", self._held)
        elif self.publisher is not None:
            self.publisher.producer.close(timeout=5)

    # -- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        publisher = self.publisher = self._connect()
        if publisher is None:
            return
        try:
            while not self._stop.is_set():
                self._wake.wait(0.2)
                self._wake.clear()
                self._assemble()
                self._publish(publisher, self.assembler.finished())
                self._settle(publisher)
            self._assemble()
            self._publish(publisher, self.assembler.drain())
            deadline = time.monotonic() + self.settings.shutdown_timeout_s
            while self._unsent and time.monotonic() < deadline:
                time.sleep(0.05)
                self._settle(publisher)
            if self._unsent:
                log.error("stopping with %d diagnoses unacknowledged by the broker", len(self._unsent))
        except PublishError as error:
            self.failed = str(error)
            log.error("POST /v1/traces stopped: %s", error)

    def _connect(self) -> Publisher | None:
        """The publisher, once the broker answers (spans are queued meanwhile, up to the bound)."""
        topics = Topics(self.settings.diagnoses_topic, self.settings.mitigations_topic, self.settings.dead_letter_topic)
        while not self._stop.is_set():
            try:
                return Publisher(self._producer, topics)
            except KafkaError as error:
                log.warning("Kafka at %s is not answering (retrying): %s", self.settings.bootstrap, error)
                self._stop.wait(1.0)
        return None

    def _assemble(self) -> None:
        while self._queue:
            spans = self._queue.popleft()
            added = self.assembler.add(spans, next(self._requests))
            if added.late_spans:  # dropped: no longer held
                log.info("dropped %d late spans of traces already diagnosed", added.late_spans)
                self._release(added.late_spans)

    def _publish(self, publisher: Publisher, traces: list[PendingTrace]) -> None:
        for start in range(0, len(traces), self.settings.batch_traces):
            batch = traces[start:start + self.settings.batch_traces]
            try:
                results = self.with_model(partial(diagnose_batch, batch=batch))
            except RuntimeError as error:  # no model loaded (yet): the traces are dead-lettered with the reason
                results = {trace.trace_id: f"diagnosis failed: {error}" for trace in batch}
            self._unsent += [(delivery, trace.spans)
                             for delivery, trace in zip(publisher.publish_all(batch, results), batch, strict=True)]

    def _settle(self, publisher: Publisher) -> None:
        if not self._unsent:
            return
        spans_of = {id(delivery): spans for delivery, spans in self._unsent}
        done, waiting = publisher.settle([delivery for delivery, _ in self._unsent])
        self._unsent = [(delivery, spans_of[id(delivery)]) for delivery in waiting]
        self._release(sum(spans_of[id(delivery)] for delivery in done))

    def _release(self, spans: int) -> None:
        with self._lock:
            self._held -= spans

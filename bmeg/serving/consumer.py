"""The streaming consumer: spans from Kafka in, one diagnosis per trace out (`bmeg consume`).

Reads the topic the OpenTelemetry Collector's Kafka exporter writes (`otlp_spans`, OTLP
protobuf by default), assembles spans into traces (`TraceAssembler`), diagnoses finished
traces in batches, publishes each trace's `Diagnosis` as JSON (key: trace id) and forwards
anomalous traces with bottlenecks to the mitigation controller's topic.

Diagnosing runs on a thread of its own, beside the loop that reads and decodes messages: the
model's tensor work releases the GIL, so the next messages are read meanwhile. One worker,
at most `MAX_BATCHES_IN_FLIGHT` batches handed to it (the loop waits beyond that).

No loss: offsets are committed only up to the lowest message with a trace still unpublished
(`OffsetTracker`; the loop releases a batch's messages once the worker has sent its
diagnoses), and only after the producer has flushed. A message that cannot be read,
or a trace the detector rejects, goes to the dead-letter topic with the reason in the
`bmeg-error` header. A graceful stop (SIGTERM) publishes every pending trace and commits.

Consumers in one group share the partitions; a trace is assembled whole only by the consumer
that gets all its spans, so producers should key by trace id (the collector's
`partition_traces_by_id: true`). When a rebalance takes partitions away, their uncommitted
messages are read again by the new owner: delivery is at least once, so a trace in flight
at that moment may be diagnosed twice (consumers of `bmeg.diagnoses` key by trace id).
kafka-python runs rebalance listeners on its network thread (while the loop waits in `poll`),
where no blocking work (diagnosing, committing) may run, so the listener only forgets the
partitions that went to another consumer; those it keeps keep their offsets and their traces.
Each message is tracked under its partition's assignment (`OffsetTracker`), so a trace still in
flight from a partition taken away never releases a message read again after it comes back;
after the poll, the loop drops the traces being assembled from partitions taken away alone
(their messages are uncommitted: their new owner reads them again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import CommitFailedError
from kafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bmeg.diagnosis import single_trace_json
from bmeg.serving.assembler import PendingTrace, TraceAssembler
from bmeg.models.detector import Detector
from bmeg.models.history import StreamHistory
from bmeg.serving.model import freeze_heap
from bmeg.serving.offsets import OffsetTracker
from bmeg.traces import TraceInputError, read_spans_bytes, to_otlp_proto_bytes

log = logging.getLogger(__name__)

ENCODINGS = {"otlp_proto": "application/x-protobuf", "otlp_json": "application/json"}
ERROR_HEADER = "bmeg-error"
#: Batches handed to the diagnosing thread and not yet published: one diagnosed, one waiting.
MAX_BATCHES_IN_FLIGHT = 2


@dataclass(frozen=True)
class ConsumerConfig:
    bootstrap: str
    topic: str = "otlp_spans"
    group_id: str = "bmeg-diagnoser"
    diagnoses_topic: str = "bmeg.diagnoses"
    mitigations_topic: str = "bmeg.mitigations"
    dead_letter_topic: str = "otlp_spans.dlq"
    encoding: str = "otlp_proto"  # when a message has no content-type header
    idle_timeout_s: float = 2.0
    max_trace_spans: int = 10_000
    batch_traces: int = 512
    commit_interval_s: float = 1.0
    poll_timeout_ms: int = 200
    max_poll_records: int = 2_000


class DiagnosedTrace(NamedTuple):
    json: bytes  # a one-trace `Diagnosis`
    anomalous: bool
    has_bottleneck: bool  # anomalous, with a service at or above the bottleneck threshold: for mitigation


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter("bmeg_consumer_messages", "Kafka messages consumed.", registry=r)
        self.spans = Counter("bmeg_consumer_spans", "Spans consumed.", registry=r)
        self.traces = Counter("bmeg_consumer_traces_diagnosed", "Traces diagnosed and published.", registry=r)
        self.anomalies = Counter("bmeg_consumer_anomalous_traces", "Anomalous traces.", registry=r)
        self.mitigations = Counter("bmeg_consumer_mitigations", "Traces forwarded to the mitigation topic.", registry=r)
        self.dead_letters = Counter("bmeg_consumer_dead_letters", "Messages and traces sent to the dead-letter topic.",
                                    ["reason"], registry=r)
        self.pending = Gauge("bmeg_consumer_pending_traces", "Traces being assembled.", registry=r)
        self.lag = Gauge("bmeg_consumer_lag", "Messages behind the partition's end.", ["partition"], registry=r)
        self.batch_seconds = Histogram("bmeg_consumer_batch_seconds", "Time to diagnose one batch of traces.",
                                       registry=r)


class StreamConsumer:
    def __init__(self, detector: Detector, config: ConsumerConfig, metrics: ConsumerMetrics | None = None):
        if config.encoding not in ENCODINGS:
            raise ValueError(f"encoding {config.encoding!r}: expected one of {sorted(ENCODINGS)}")
        self.detector = detector
        self.history = StreamHistory(visits=detector.encoder.history)  # the stream's past, for history features
        self.config = config
        self.metrics = metrics or ConsumerMetrics()
        self.assembler = TraceAssembler(config.idle_timeout_s, config.max_trace_spans)
        self.offsets = OffsetTracker()
        self._committed: dict[TopicPartition, int] = {}
        self._last_commit = time.monotonic()
        # One message per diagnosis: big batches spare kafka-python a network-thread wake-up per send.
        self.producer = KafkaProducer(bootstrap_servers=config.bootstrap, acks="all", linger_ms=50,
                                      batch_size=512 * 1024)
        self.consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap, group_id=config.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", max_poll_records=config.max_poll_records,
        )
        self.consumer.subscribe([config.topic], listener=_Rebalance(self))
        self._diagnoser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmeg-diagnoser")
        self._in_flight: deque[Future[list[PendingTrace]]] = deque()  # oldest first
        self._revoked = threading.Event()  # set by the rebalance listener, handled by the loop

    # -- the loop ----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Consume until `stop` is set, then publish every pending trace, commit and close."""
        # The model and the libraries live as long as the process: out of the collector's
        # sight, the full collections that each batch's thousands of result objects trigger
        # walk only the new objects (they cost as much as the model's forward pass before).
        freeze_heap()
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()

    def step(self) -> None:
        """One poll: take its messages, diagnose the traces that finished, commit when due."""
        batches = self.consumer.poll(timeout_ms=self.config.poll_timeout_ms)
        if self._revoked.is_set():  # a rebalance ran inside that poll: before its messages are added
            self._revoked.clear()
            self._drop_revoked()
        for partition, messages in batches.items():
            for message in messages:
                self._take(partition, message)
        self._submit(self.assembler.finished())
        if time.monotonic() - self._last_commit >= self.config.commit_interval_s:
            self.commit()

    def close(self) -> None:
        try:
            self.flush_all()
        finally:
            self._diagnoser.shutdown()
            self.consumer.close(autocommit=False)
            self.producer.close()

    def flush_all(self) -> None:
        """Diagnose and publish every trace still being assembled, then commit (graceful shutdown)."""
        self._submit(self.assembler.drain())
        self._release_published(wait=True)
        self.commit()

    def commit(self) -> None:
        self._release_published()
        self.producer.flush()  # a released offset means "sent"; it must also mean "delivered"
        points = {tp: offset for tp, offset in self.offsets.commit_points().items() if self._committed.get(tp) != offset}
        if points:
            try:
                self.consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in points.items()})
            except CommitFailedError as error:  # a rebalance won the race: the new owners re-read
                log.warning("commit refused during a rebalance (messages will be read again): %s", error)
            else:
                self._committed.update(points)
        self._last_commit = time.monotonic()
        self._update_lag()

    # -- messages in -------------------------------------------------------------------------
    def _take(self, partition: TopicPartition, message) -> None:
        self.metrics.messages.inc()
        source = self.offsets.source(partition, message.offset)
        origin = f"{partition.topic}/{partition.partition}@{message.offset}"
        try:
            spans = self._decode(message)
        except Exception as error:  # noqa: BLE001 - a poison message must not stop the stream
            if isinstance(error, TraceInputError):
                reason = f"undecodable message: {error}"
            else:  # a reader bug: keep the message and the traceback for whoever fixes it
                log.error("reading %s failed", origin, exc_info=error)
                reason = f"reader failed: {type(error).__name__}: {error}"
            self._dead_letter(message.key, message.value or b"", reason, origin)
            self.offsets.received(source, 0)
            return
        self.metrics.spans.inc(spans.num_rows)
        self.offsets.received(source, self.assembler.add(spans, source))
        self.metrics.pending.set(len(self.assembler))

    def _decode(self, message) -> pa.Table:
        if not message.value:
            raise TraceInputError("empty message (no spans)")
        headers = {key.lower(): value for key, value in (message.headers or [])}
        content_type = headers.get("content-type", b"").decode("latin-1") or ENCODINGS[self.config.encoding]
        return read_spans_bytes(message.value, content_type)

    # -- diagnoses out -----------------------------------------------------------------------
    def _submit(self, traces: list[PendingTrace]) -> None:
        """Hand finished traces to the diagnosing thread in batches, waiting while it is behind."""
        for start in range(0, len(traces), self.config.batch_traces):
            while len(self._in_flight) >= MAX_BATCHES_IN_FLIGHT:
                self._release(self._in_flight.popleft().result())
            self._in_flight.append(self._diagnoser.submit(self._publish, traces[start:start + self.config.batch_traces]))
        self._release_published()
        self.metrics.pending.set(len(self.assembler))

    def _release_published(self, wait: bool = False) -> None:
        """Release the messages of the batches published so far (of all of them with `wait`).
        A batch that failed raises its error here, in the loop."""
        while self._in_flight and (wait or self._in_flight[0].done()):
            self._release(self._in_flight.popleft().result())

    def _release(self, published: list[PendingTrace]) -> None:
        for trace in published:
            for source in trace.sources:
                self.offsets.release(source)

    def _publish(self, batch: list[PendingTrace]) -> list[PendingTrace]:
        """On the diagnosing thread: diagnose a batch and send each result (or its dead letter)."""
        with self.metrics.batch_seconds.time():
            results = self._diagnose(batch)
        for trace in batch:
            outcome = results.get(trace.trace_id)
            if isinstance(outcome, DiagnosedTrace):
                self._send_diagnosis(trace.trace_id, outcome)
            else:
                self._dead_letter(trace.trace_id.encode(), to_otlp_proto_bytes(trace.table()),
                                  outcome or "the detector returned no diagnosis for this trace",
                                  origin=f"trace {trace.trace_id}")
        return batch

    def _diagnose(self, batch: list[PendingTrace]) -> dict[str, DiagnosedTrace | str]:
        """Each trace's diagnosis, or the reason it could not be diagnosed."""
        try:
            document = self.detector.diagnosis_document(pa.concat_tables([part for t in batch for part in t.parts]),
                                                        history=self.history)
        except Exception as error:  # noqa: BLE001 - a bad trace must not stop the stream: find it
            if len(batch) == 1:
                return {batch[0].trace_id: _reason(error, batch[0].trace_id)}
            results: dict[str, DiagnosedTrace | str] = {}
            for trace in batch:
                results.update(self._diagnose([trace]))
            return results
        return {
            trace["trace_id"]: DiagnosedTrace(
                single_trace_json(document, trace), trace["anomalous"],
                trace["anomalous"] and any(score["bottleneck"] for score in trace["bottlenecks"]))
            for trace in document["traces"]
        }

    def _send_diagnosis(self, trace_id: str, diagnosed: DiagnosedTrace) -> None:
        key = trace_id.encode()
        self.producer.send(self.config.diagnoses_topic, key=key, value=diagnosed.json)
        self.metrics.traces.inc()
        if diagnosed.anomalous:
            self.metrics.anomalies.inc()
        if diagnosed.has_bottleneck:
            self.producer.send(self.config.mitigations_topic, key=key, value=diagnosed.json)
            self.metrics.mitigations.inc()

    def _dead_letter(self, key: bytes | None, value: bytes, reason: str, origin: str) -> None:
        log.warning("dead-lettered %s: %s", origin, reason)
        headers = [(ERROR_HEADER, reason.encode()), ("bmeg-origin", origin.encode())]
        self.producer.send(self.config.dead_letter_topic, key=key, value=value, headers=headers)
        self.metrics.dead_letters.labels(reason.split(":")[0]).inc()

    def _update_lag(self) -> None:
        for tp in self.consumer.assignment():
            end, position = self.consumer.highwater(tp), self._committed.get(tp)
            if end is not None and position is not None:
                self.metrics.lag.labels(str(tp.partition)).set(max(end - position, 0))

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions taken away (on kafka-python's network thread): their messages are no
        longer ours to commit; the loop drops the traces assembled from them alone."""
        partitions = list(partitions)
        self.offsets.forget(partitions)
        for tp in partitions:
            self._committed.pop(tp, None)
        self._revoked.set()

    def _drop_revoked(self) -> None:
        """Traces whose every message came from partitions taken away: their new owner reads
        those messages again (none was committed) and diagnoses them; keeping them here would
        diagnose them twice, or whole with the spans read again."""
        dropped = self.assembler.discard(lambda trace: not any(map(self.offsets.is_current, trace.sources)))
        if dropped:
            log.info("dropped %d traces being assembled from revoked partitions (their new owner reads them)", dropped)
        self.metrics.pending.set(len(self.assembler))


def _reason(error: Exception, trace_id: str) -> str:
    if isinstance(error, TraceInputError):
        return f"invalid trace: {error}"
    log.error("diagnosing trace %s failed", trace_id, exc_info=error)
    return f"diagnosis failed: {type(error).__name__}: {error}"


class _Rebalance(ConsumerRebalanceListener):
    """Runs on kafka-python's network thread: cheap bookkeeping only (see the module docstring).

    Under the eager protocol every partition is "revoked" before each rebalance, and those
    assigned again keep their read positions: only the partitions revoked and not assigned
    again (or lost outright) are forgotten. Their messages are read again by their next owner,
    from the last commit."""

    def __init__(self, owner: StreamConsumer):
        self.owner = owner
        self.revoking: set[TopicPartition] = set()

    def on_partitions_revoked(self, revoked) -> None:
        log.info("revoked partitions %s", sorted(tp.partition for tp in revoked))
        self.revoking |= set(revoked)

    def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned partitions %s", sorted(tp.partition for tp in assigned))
        gone, self.revoking = self.revoking - set(assigned), set()
        if gone:
            self.owner.forget(gone)

    def on_partitions_lost(self, lost) -> None:
        log.info("lost partitions %s", sorted(tp.partition for tp in lost))
        self.revoking -= set(lost)
        self.owner.forget(lost)

"""The streaming consumer: spans from Kafka in, one diagnosis per trace out (`bmeg consume`).

Reads the topic the OpenTelemetry Collector's Kafka exporter writes (`otlp_spans`), in any of
its encodings: by the message's content-type header when it has one, else detected from the
bytes (the Collector sets none: `bmeg.traces.io.detect_encoding`). Values compressed with gzip
are inflated up to `max_message_bytes`; the Kafka codecs (gzip, snappy, lz4, zstd) are
kafka-python's, with their libraries installed. Spans are assembled into traces
(`TraceAssembler`: complete at once when the root and every expected span are in, else after
the idle timeout), finished traces are diagnosed in batches on a thread of their own (the
model's tensor work releases the GIL, so the next messages are read meanwhile; at most
`MAX_BATCHES_IN_FLIGHT` batches handed to it) and published by `Publisher`.

At least once, and never wedged: a message's offset is released (`OffsetTracker`) only when
every record its traces owe (diagnosis, forward to mitigation, dead letter) has been
acknowledged by the broker; a message that cannot be read, a trace the detector rejects and a
diagnosis too large to publish go to the dead-letter topic (truncated, the reason in the
`bmeg-error` header) and the partition moves on. Every call into Kafka has a timeout, so a
broker outage of any length is waited out by a loop that keeps running, and resumes by itself;
`heartbeat` is the time the loop last went round (`/healthz` on the metrics port fails when it
is older than `liveness_timeout_s`). Whether the broker answers and the topic exists is asked
on a thread of its own (`BrokerWatch`, once every `broker_check_s`), never by the loop; the
assembler's idle clock counts only up to the broker's last answer, and after an outage no
trace finishes on idle time while the senders' exporters retry what they queued meanwhile
(`TraceAssembler.heard_from_broker`); the producer is renewed then (kafka-python's, backed off
from reconnecting, once sent nothing for minutes after the broker's return). A stop (SIGTERM)
publishes every pending trace, waits for the broker, commits what is acknowledged and closes,
all within `shutdown_timeout_s`.

Consumers in one group share the partitions with the cooperative-sticky assignor (KIP-429):
a rebalance moves only the partitions that change owner, and the others keep their traces and
offsets. A trace is assembled whole only by the consumer that gets all its spans, so producers
should key by trace id (the Collector's `partition_traces_by_id: true`). kafka-python runs
rebalance listeners on its network thread, where no blocking work may run: the listener only
forgets the partitions taken away (their messages, never committed past an unpublished trace,
are read again by their new owner); after the poll, the loop drops the traces being assembled
from those partitions alone. Each message is tracked under its partition's assignment, so a
trace still in flight from a partition taken away never releases a message read again.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bmeg.models.detector import Detector
from bmeg.models.history import StreamHistory
from bmeg.serving.assembler import (DEFAULT_IDLE_TIMEOUT_S, DEFAULT_LATE_WINDOW_S, DEFAULT_MAX_OPEN,
                                    DEFAULT_OUTAGE_AFTER_S, PendingTrace, TraceAssembler)
from bmeg.serving.brokerwatch import BrokerWatch
from bmeg.serving.model import freeze_heap
from bmeg.serving.offsets import OffsetTracker, Source
from bmeg.serving.publishing import (ERROR_HEADER, Delivery, Publisher, Topics, diagnose_batch,
                                     make_producer)
from bmeg.traces import TraceInputError
from bmeg.traces.io import detect_encoding, read_spans_bytes

__all__ = ["ERROR_HEADER", "ConsumerConfig", "ConsumerMetrics", "StreamConsumer", "serve_probes"]

log = logging.getLogger(__name__)

#: The encodings the Collector's Kafka exporter writes, and the content type each reads as.
ENCODINGS = {"otlp_proto": "application/x-protobuf", "otlp_json": "application/json"}
#: Batches handed to the diagnosing thread and not yet published: one diagnosed, one waiting.
MAX_BATCHES_IN_FLIGHT = 2
#: New container objects between the collector's young-generation passes while consuming (Python's
#: default: 700). A batch's results (~30 dicts and lists a trace) outlive hundreds of passes at
#: 700 and are walked again in the older generations: ~19 µs of collection a trace end to end,
#: ~9 at this setting (measured with `gc.callbacks`, one trace per message).
YOUNG_OBJECTS_PER_COLLECTION = 20_000
#: OTLP protobuf messages of one partition read as one (bounds the work redone when one is bad).
MAX_RUN_MESSAGES = 500
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class ConsumerConfig:
    bootstrap: str
    topic: str = "otlp_spans"
    group_id: str = "bmeg-diagnoser"
    diagnoses_topic: str = "bmeg.diagnoses"
    mitigations_topic: str = "bmeg.mitigations"
    dead_letter_topic: str = "otlp_spans.dlq"
    encoding: str | None = None  # of messages without a content-type header; None: detected from the bytes
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    late_window_s: float = DEFAULT_LATE_WINDOW_S
    max_trace_spans: int = 10_000
    max_open_traces: int = DEFAULT_MAX_OPEN  # traces assembled at once; beyond, the oldest finishes early
    batch_traces: int = 512
    commit_interval_s: float = 1.0
    poll_timeout_ms: int = 200
    max_poll_records: int = 2_000
    # Raw bytes one fetch brings (kafka-python's defaults, stated: the memory figures rest on them)
    fetch_max_bytes: int = 50 << 20
    max_partition_fetch_bytes: int = 1 << 20
    max_message_bytes: int = 64 << 20  # a message's spans, inflated
    dead_letter_max_bytes: int = 256 << 10
    max_unsent_traces: int = 50_000  # fetching pauses beyond this many traces awaiting the broker
    kafka_timeout_s: float = 10.0  # each commit, flush and close
    shutdown_timeout_s: float = 20.0
    liveness_timeout_s: float = 60.0
    broker_check_s: float = 1.0  # how often the broker is asked whether it answers and the topic exists
    outage_after_s: float = DEFAULT_OUTAGE_AFTER_S  # no answer for this long: an outage (see the assembler)


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter("bmeg_consumer_messages", "Kafka messages consumed.", registry=r)
        self.spans = Counter("bmeg_consumer_spans", "Spans consumed.", registry=r)
        self.late_spans = Counter("bmeg_consumer_late_spans", "Spans of traces already diagnosed, dropped.", registry=r)
        self.redelivered_spans = Counter(
            "bmeg_consumer_redelivered_spans", "Spans of traces already diagnosed, in messages read again (a rebalance "
            "hands back offsets not yet committed), dropped.", registry=r)
        self.traces = Counter("bmeg_consumer_traces_diagnosed", "Traces diagnosed and published.", registry=r)
        self.partial = Counter("bmeg_consumer_partial_traces", "Traces finished without their root or a parent.",
                               registry=r)
        self.anomalies = Counter("bmeg_consumer_anomalous_traces", "Anomalous traces.", registry=r)
        self.mitigations = Counter("bmeg_consumer_mitigations", "Traces forwarded to the mitigation topic.", registry=r)
        self.dead_letters = Counter("bmeg_consumer_dead_letters", "Messages and traces sent to the dead-letter topic.",
                                    ["reason"], registry=r)
        self.retries = Counter("bmeg_consumer_send_retries", "Records sent again after a failed send.", registry=r)
        self.unsent = Gauge("bmeg_consumer_unsent_traces", "Traces diagnosed, awaiting the broker's acknowledgement.",
                            registry=r)
        self.pending = Gauge("bmeg_consumer_pending_traces", "Traces being assembled.", registry=r)
        self.lag = Gauge("bmeg_consumer_lag", "Messages behind the partition's end.", ["partition"], registry=r)
        self.heartbeat = Gauge("bmeg_consumer_heartbeat_seconds", "Unix time the poll loop last went round.",
                               registry=r)
        self.batch_seconds = Histogram("bmeg_consumer_batch_seconds", "Time to diagnose one batch of traces.",
                                       registry=r)


class StreamConsumer:
    def __init__(self, detector: Detector, config: ConsumerConfig, metrics: ConsumerMetrics | None = None):
        if config.encoding is not None and config.encoding not in ENCODINGS:
            raise ValueError(f"encoding {config.encoding!r}: expected one of {sorted(ENCODINGS)}")
        self.detector = detector
        # the stream's past, for history features (a model that is not a Detector keeps none)
        self.history = StreamHistory(visits=detector.encoder.history) if isinstance(detector, Detector) else None
        self.config = config
        self.metrics = metrics or ConsumerMetrics()
        self.assembler = TraceAssembler(config.idle_timeout_s, config.max_trace_spans,
                                        late_window_s=config.late_window_s, max_open=config.max_open_traces,
                                        outage_after_s=config.outage_after_s)
        self.offsets = OffsetTracker()
        self.heartbeat = time.monotonic()
        self._committed: dict[TopicPartition, int] = {}
        self._last_commit = time.monotonic()
        self.publisher = Publisher(partial(make_producer, config.bootstrap), Topics(config.diagnoses_topic, config.mitigations_topic,
                                                         config.dead_letter_topic), config.dead_letter_max_bytes)
        self.consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap, group_id=config.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", max_poll_records=config.max_poll_records,
            fetch_max_bytes=config.fetch_max_bytes, max_partition_fetch_bytes=config.max_partition_fetch_bytes,
            partition_assignment_strategy=[CooperativeStickyAssignor],
            # members learn of a rebalance by heartbeat: at 1 s (the library's 3 s default) the
            # replicas of a rollout rejoin, and commit, within a stop's shutdown budget
            heartbeat_interval_ms=1_000,
            # reconnecting backs off at most 2 s (the library's grows to 30 s): reads resume within
            # seconds of the broker's return, while the assembler waits for the senders' retries
            reconnect_backoff_max_ms=2_000,
        )
        self._subscribed = False  # until the topic exists: see `_subscribe_once_the_topic_exists`
        self._waiting_logged = False
        self.broker = BrokerWatch(config.bootstrap, config.topic, config.broker_check_s,
                                  timeout_s=min(config.kafka_timeout_s, 2 * config.broker_check_s))
        self._diagnoser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmeg-diagnoser")
        self._in_flight: deque[Future[list[Delivery]]] = deque()  # oldest first
        self._unsent: list[Delivery] = []  # published, not yet all acknowledged
        self._paused = False
        self._revoked = threading.Event()  # set by the rebalance listener, handled by the loop

    # -- the loop ----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Consume until `stop` is set, then publish every pending trace, commit and close."""
        # The model and the libraries live as long as the process: out of the collector's
        # sight, the full collections that each batch's thousands of result objects trigger
        # walk only the new objects (they cost as much as the model's forward pass before).
        freeze_heap()
        thresholds = gc.get_threshold()
        gc.set_threshold(YOUNG_OBJECTS_PER_COLLECTION, *thresholds[1:])
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()
            gc.set_threshold(*thresholds)

    def step(self) -> None:
        """One poll: take its messages, diagnose the traces that finished, commit when due."""
        self._beat()
        if self.assembler.heard_from_broker(self.broker.last_contact):
            log.warning("the broker is back: no trace finishes on idle time for %.0f s, then each trace held waits "
                        "a whole idle timeout (%d held)", self.assembler.recovery_s, len(self.assembler))
            self.publisher.renew_producer("the broker is back after an outage")
        if not self._subscribed and not self._subscribe_once_the_topic_exists():
            time.sleep(self.config.poll_timeout_ms / 1e3)
            return
        self._throttle()
        self._rejoin_if_a_join_was_dropped()
        try:
            batches = self.consumer.poll(timeout_ms=self.config.poll_timeout_ms)
        except KafkaError as error:  # the broker is away: kafka-python reconnects by itself
            log.warning("poll failed (retrying): %s", error)
            batches = {}
        if self._revoked.is_set():  # a rebalance ran inside that poll: before its messages are added
            self._revoked.clear()
            self._drop_revoked()
        for partition, messages in batches.items():
            self._take_partition(partition, messages)
        self._submit(self.assembler.finished())
        if time.monotonic() - self._last_commit >= self.config.commit_interval_s:
            self.commit()

    def _subscribe_once_the_topic_exists(self) -> bool:
        """Subscribe to the topic once the broker lists its partitions (`BrokerWatch` asks once
        every `broker_check_s`; the loop never waits on the broker for it).

        A consumer that subscribes before the topic exists (the Collector's first write creates
        it) is assigned nothing, then rejoins when the topic appears; kafka-python 3.0.12 can
        drop the result of that second join when it spans two polls (the join loop stops once
        the leader's own snapshot matches, before the assignment is applied), and the member,
        with its heartbeat off, sits unassigned until the broker evicts it: every message lost
        to this consumer. Joining only when the partitions are known makes the first join the
        one that assigns them."""
        if not self.broker.partitions:
            if not self._waiting_logged:
                log.info("waiting for the topic %s to exist", self.config.topic)
                self._waiting_logged = True
            return False
        self.consumer.subscribe([self.config.topic], listener=_Rebalance(self))
        self._subscribed = True
        return True

    def healthy(self) -> bool:
        """Liveness: the loop went round within `liveness_timeout_s`."""
        return time.monotonic() - self.heartbeat < self.config.liveness_timeout_s

    def close(self) -> None:
        """Publish what is pending, commit what is acknowledged and close, all within
        `shutdown_timeout_s` (a broker that is away must not hold a SIGTERM past the pod's grace
        period): half of it waiting for acknowledgements, a quarter for the commit, the rest to
        close. Whatever is unacknowledged then stays uncommitted and is read again."""
        budget = self.config.shutdown_timeout_s
        try:
            self.flush_all(acks_timeout_s=budget / 2, commit_timeout_s=min(budget / 4, self.config.kafka_timeout_s))
        finally:
            self._diagnoser.shutdown(wait=False, cancel_futures=True)
            closing_s = min(budget / 8, self.config.kafka_timeout_s)
            self.broker.close(timeout_s=closing_s)
            for name, close in (("consumer", lambda: self.consumer.close(autocommit=False, timeout_ms=int(closing_s * 1e3))),
                                ("producer", lambda: self.publisher.producer.close(timeout=closing_s))):
                try:
                    close()
                except KafkaError as error:  # the broker is away: nothing more to save
                    log.warning("closing the Kafka %s: %s", name, error)

    def flush_all(self, acks_timeout_s: float | None = None, commit_timeout_s: float | None = None) -> None:
        """Diagnose and publish every trace still being assembled, wait for the broker's
        acknowledgements at most `acks_timeout_s` (default `shutdown_timeout_s`), then commit."""
        deadline = time.monotonic() + (self.config.shutdown_timeout_s if acks_timeout_s is None else acks_timeout_s)
        # at max_open_traces a full drain took 72 s (bench/consumer_limits.py): past the deadline the
        # rest stay unpublished, their messages uncommitted, read again by the next owner
        self._submit(self.assembler.drain(), deadline)
        while (self._in_flight or self._unsent) and time.monotonic() < deadline:
            self._beat()
            if self._in_flight:
                _wait(self._in_flight[0], timeout_s=0.2)
            else:
                time.sleep(0.05)  # the producer's own thread sends; acknowledgements come meanwhile
            self._settle()
        if self._in_flight or self._unsent:
            log.error("stopping with %d traces unacknowledged by the broker: their messages stay uncommitted "
                      "and are read again", len(self._unsent) + len(self._in_flight) * self.config.batch_traces)
        self._commit_through_a_rebalance(commit_timeout_s or self.config.kafka_timeout_s)

    def _commit_through_a_rebalance(self, timeout_s: float) -> None:
        """Commit, rejoining the group first when it refuses the commit for a rebalance.

        Replicas stopped together (a rollout, a scale-down) each leave the group, and the
        rebalance one starts meets the others while they stop: the group refuses their last
        commit until they have rejoined, and all they finished would be read and diagnosed again.
        So rejoin by polling with every partition paused (a record such a poll still returns,
        from a partition just assigned, is not taken: its next owner reads it) and commit again,
        all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.commit(max(deadline - time.monotonic(), 0.1)) and time.monotonic() < deadline:
            self.consumer.pause(*self.consumer.assignment())
            self._rejoin_if_a_join_was_dropped()
            try:
                self.consumer.poll(timeout_ms=int(min(max(deadline - time.monotonic(), 0.05), 1.0) * 1e3))
            except KafkaError as error:
                log.warning("rejoining the group to commit: %s", error)
            if self._revoked.is_set():
                self._revoked.clear()
                self._drop_revoked()

    def _rejoin_if_a_join_was_dropped(self) -> None:
        """kafka-python 3.0.12 (the newest) drops the result of a group join that finishes
        between two polls: its join loop ends once the leader's own metadata snapshot matches,
        before the assignment is applied, and the member stays `rebalancing` with heartbeats off,
        every commit refused, until the broker evicts it. When no join is in flight any more
        but the member still waits for one, ask for a new join: the next poll makes it."""
        coordinator = self.consumer._coordinator
        join = coordinator._join_task
        if coordinator.rebalance_in_progress() and join is not None and join.is_done and not coordinator.need_rejoin():
            log.info("the group join finished between two polls and was dropped by the library: joining again")
            coordinator.request_rejoin()

    def commit(self, timeout_s: float | None = None) -> bool:
        """Commit every offset whose traces are all acknowledged; True when the group refused
        the commit because it is rebalancing (the next commit, after the rejoin, carries them)."""
        self._settle()
        points = {tp: offset for tp, offset in self.offsets.commit_points().items() if self._committed.get(tp) != offset}
        self._last_commit = time.monotonic()
        refused = False
        if points:
            try:
                self.consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in points.items()},
                                     timeout_ms=int((timeout_s or self.config.kafka_timeout_s) * 1e3))
            except (CommitFailedError, RebalanceInProgressError) as error:  # partitions moving: re-read if they go
                log.warning("commit refused during a rebalance: %s", error)
                refused = True
            except KafkaError as error:  # the broker is away: the next commit carries these offsets too
                log.warning("commit failed (retrying at the next): %s", error)
            else:
                self._committed.update(points)
        self._update_lag()
        return refused

    # -- messages in -------------------------------------------------------------------------
    def _take_partition(self, partition: TopicPartition, messages: list) -> None:
        """A partition's messages of one poll, in offset order. Consecutive OTLP protobuf
        messages are read as one: their bytes concatenated are one `ExportTraceServiceRequest`
        (protobuf appends repeated fields), so the reader's fixed cost is paid once per run, not
        once per message (with `partition_traces_by_id` the Collector writes a message per
        trace). A run the reader refuses is taken message by message, so only the bad one is
        dead-lettered."""
        run: list[tuple[Any, bytes]] = []
        for message in messages:
            data = self._protobuf(message)
            if data is None or len(run) >= MAX_RUN_MESSAGES:
                self._take_run(partition, run)
                run = []
            if data is None:
                self._take(partition, message)
            else:
                run.append((message, data))
        self._take_run(partition, run)

    def _take_run(self, partition: TopicPartition, run: list[tuple[Any, bytes]]) -> None:
        if len(run) <= 1:
            for message, _ in run:
                self._take(partition, message)
            return
        try:
            spans = read_spans_bytes(b"".join(data for _, data in run), encoding="otlp_proto")
        except Exception:  # noqa: BLE001 - one of them is bad: find it
            for message, _ in run:
                self._take(partition, message)
            return
        first, last = run[0][0], run[-1][0]
        self._add(self.offsets.source(partition, first.offset), spans, len(run), last.offset)

    def _take(self, partition: TopicPartition, message) -> None:
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
            self.metrics.messages.inc()
            self.offsets.received(source, 1)  # open until its dead letter is acknowledged
            self._unsent.append(self.publisher.dead_letter([source], message.key, message.value or b"", reason, origin))
            return
        self._add(source, spans, 1)

    def _add(self, source: Source, spans: pa.Table, messages: int, last_offset: int | None = None) -> None:
        self.metrics.messages.inc(messages)
        self.metrics.spans.inc(spans.num_rows)
        added = self.assembler.add(spans, source)
        read_before = self.offsets.received(source, added.traces, last_offset)
        if added.late_spans:  # a finished trace's spans read again are no late fragment
            (self.metrics.redelivered_spans if read_before else self.metrics.late_spans).inc(added.late_spans)
        self.metrics.pending.set(len(self.assembler))

    def _protobuf(self, message) -> bytes | None:
        """The message's bytes (inflated) when it holds OTLP protobuf, else None (as when it
        cannot be told: `_take` then reads it alone and says why)."""
        data: bytes = message.value or b""
        headers = {key.lower(): value for key, value in (message.headers or [])}
        content_type = headers.get("content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        try:
            if data[:2] == _GZIP_MAGIC:
                data = inflate(data, self.config.max_message_bytes)
            if not data or (content_type and content_type != ENCODINGS["otlp_proto"]):
                return None
            if not content_type and (self.config.encoding or detect_encoding(data, "otlp_proto")) != "otlp_proto":
                return None
        except TraceInputError:
            return None
        return data

    def _decode(self, message) -> pa.Table:
        data: bytes = message.value or b""
        if not data:
            raise TraceInputError("empty message (no spans)")
        if data[:2] == _GZIP_MAGIC:
            data = inflate(data, self.config.max_message_bytes)
        headers = {key.lower(): value for key, value in (message.headers or [])}
        content_type = headers.get("content-type", b"").decode("latin-1")
        if content_type:
            return read_spans_bytes(data, content_type)
        encoding = self.config.encoding or detect_encoding(data)
        if encoding not in ENCODINGS:
            return read_spans_bytes(data, encoding=encoding)  # Jaeger and Zipkin
        return read_spans_bytes(data, ENCODINGS[encoding])

    # -- diagnoses out -----------------------------------------------------------------------
    def _submit(self, traces: list[PendingTrace], deadline: float | None = None) -> None:
        """Hand finished traces to the diagnosing thread in batches, waiting while it is behind;
        none after `deadline` (monotonic), if given."""
        for start in range(0, len(traces), self.config.batch_traces):
            if deadline is not None and time.monotonic() >= deadline:
                log.error("stopping: %d traces not diagnosed in time; their messages stay uncommitted and are read "
                          "again", len(traces) - start)
                break
            while len(self._in_flight) >= MAX_BATCHES_IN_FLIGHT:
                self._unsent += self._in_flight.popleft().result()
            self._in_flight.append(self._diagnoser.submit(self._publish, traces[start:start + self.config.batch_traces]))
        self._settle()
        self.metrics.pending.set(len(self.assembler))

    def _settle(self) -> None:
        """Collect the batches published so far and release the messages of every trace whose
        records are all acknowledged. A batch that failed raises its error here, in the loop."""
        while self._in_flight and self._in_flight[0].done():
            self._unsent += self._in_flight.popleft().result()
        done, self._unsent = self.publisher.settle(self._unsent)
        for delivery in done:
            for source in delivery.sources:
                self.offsets.release(source)
        self._count()

    def _publish(self, batch: list[PendingTrace]) -> list[Delivery]:
        """On the diagnosing thread: diagnose a batch and send each result (or its dead letter)."""
        with self.metrics.batch_seconds.time():
            results = diagnose_batch(self.detector, batch, history=self.history)
        self.metrics.partial.inc(sum(trace.partial for trace in batch))
        return self.publisher.publish_all(batch, results)

    def _count(self) -> None:
        counts = self.publisher.counts.take()
        self.metrics.traces.inc(counts.diagnoses)
        self.metrics.anomalies.inc(counts.anomalies)
        self.metrics.mitigations.inc(counts.mitigations)
        self.metrics.retries.inc(counts.retries)
        for reason, count in counts.dead_letters.items():
            self.metrics.dead_letters.labels(reason).inc(count)
        self.metrics.unsent.set(len(self._unsent))

    def _throttle(self) -> None:
        """Pause fetching while too many traces await the broker (it is away): memory stays bounded."""
        over = len(self._unsent) > self.config.max_unsent_traces
        if over != self._paused:
            partitions = list(self.consumer.assignment())
            (self.consumer.pause if over else self.consumer.resume)(*partitions)
            self._paused = over
            log.warning("%s fetching: %d traces await the broker", "pausing" if over else "resuming", len(self._unsent))

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()
        self.metrics.heartbeat.set(time.time())

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


def _wait(future: Future, timeout_s: float) -> None:
    try:
        future.exception(timeout=timeout_s)
    except TimeoutError:
        pass


def inflate(data: bytes, limit: int) -> bytes:
    """Gunzip at most `limit` bytes (a small message may inflate to gigabytes)."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as error:
        raise TraceInputError(f"corrupt gzip data: {error}") from None
    if len(out) > limit:
        raise TraceInputError(f"gzip data inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise TraceInputError("truncated gzip data")
    return out


class _Rebalance(ConsumerRebalanceListener):
    """Runs on kafka-python's network thread: cheap bookkeeping only (see the module docstring).
    Under the cooperative protocol only the partitions that change owner are revoked."""

    def __init__(self, owner: StreamConsumer):
        self.owner = owner

    def on_partitions_revoked(self, revoked) -> None:
        log.info("revoked partitions %s", sorted(tp.partition for tp in revoked))
        if revoked:
            self.owner.forget(revoked)

    def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned partitions %s", sorted(tp.partition for tp in assigned))

    def on_partitions_lost(self, lost) -> None:
        log.info("lost partitions %s", sorted(tp.partition for tp in lost))
        self.owner.forget(lost)


def serve_probes(consumer: StreamConsumer, host: str, port: int) -> ThreadingHTTPServer:
    """`/metrics` (Prometheus) and `/healthz` (200 while the loop goes round, else 503) on a
    daemon thread; returns the server (`shutdown()` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.startswith("/healthz"):
                age = time.monotonic() - consumer.heartbeat
                ok = consumer.healthy()
                status, body, kind = (200 if ok else 503), f'{{"status": "{"ok" if ok else "stuck"}", ' \
                    f'"loop_seconds_ago": {age:.1f}}}'.encode(), "application/json"
            elif self.path.startswith("/metrics"):
                status, body, kind = 200, generate_latest(consumer.metrics.registry), CONTENT_TYPE_LATEST
            else:
                status, body, kind = 404, b"not found: /metrics or /healthz\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # probes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="bmeg-probes", daemon=True).start()
    return server

"""Finished traces to diagnoses on Kafka, at least once: shared by `bmeg consume` and `POST /v1/traces`.

`diagnose_batch` diagnoses a batch of assembled traces in one model call (each trace alone
when the call fails, so one bad trace fails only itself) and lays out what each trace
publishes: its one-trace `Diagnosis` as JSON, with the mitigation hints on anomalous traces
(as REST answers), its start time, and `partial` when the assembler never saw its root or a
parent. A trace is forwarded to the mitigation topic only when it is anomalous, names a
bottleneck service and is not partial.

`Publisher` sends them and keeps each trace's sends as a `Delivery`; `settle` checks the send
futures and answers which deliveries are done, so a caller releases a trace's messages only
once every record it owes has been acknowledged. A failed send is
- too large for the producer or the broker: replaced by a dead letter (the record truncated to
  `dead_letter_max_bytes`, its reason in the `bmeg-error` header), so the partition moves on.
  kafka-python fails every record of the batch (and of the batches pending beside it) with the
  same error, so a record no larger than a dead letter is sent again instead, as below;
- retriable (broker away, timeouts, leader changes): sent again with a capped backoff, for as
  long as it takes: a broker outage of any length is waited out;
- anything else: sent again `max_attempts` times, then `PublishError` stops the caller (the
  trace's messages stay uncommitted and are read again after a restart).
No call blocks for long: `send` waits at most the producer's `max_block_ms` (1 s) for metadata
or buffer space, and a pass of `settle` stops resending at the first send that times out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyarrow as pa
from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError, MessageSizeTooLargeError
from kafka.producer.future import FutureRecordMetadata

from bmeg.diagnosis import single_trace_json
from bmeg.mitigation.planner import trace_hints
from bmeg.models.history import StreamHistory
from bmeg.serving.assembler import PendingTrace, spans_of
from bmeg.serving.partitioning import BatchPartitioner
from bmeg.traces import TraceInputError, to_otlp_proto_bytes

log = logging.getLogger(__name__)

ERROR_HEADER = "bmeg-error"
ORIGIN_HEADER = "bmeg-origin"
TRUNCATED_HEADER = "bmeg-truncated"  # the record's full size, when the dead letter holds only its start
#: Errors a broker answers when a record is over its `max.message.bytes` (MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE).
_TOO_LARGE_ERRNOS = {10, 18}


class PublishError(RuntimeError):
    """A record could not be published after every retry: the stream must stop, uncommitted."""


class DiagnosedTrace(NamedTuple):
    json: bytes  # a one-trace `Diagnosis`
    anomalous: bool
    forward: bool  # to the mitigation topic: anomalous, a bottleneck named, the trace whole


def diagnose_batch(detector, batch: list[PendingTrace],
                   history: StreamHistory | None = None) -> dict[str, DiagnosedTrace | str]:
    """Each trace's diagnosis, or the reason it could not be diagnosed; `detector` is a
    `bmeg.models.detector.Detector` read with the stream's `history` (the consumer's), or any model
    with `diagnose` that keeps its own (the server's `StreamedDetector`, its model process)."""
    try:
        document = _document(detector, spans_of(batch), history)
    except Exception as error:  # noqa: BLE001 - a bad trace must not stop the stream: find it
        if len(batch) == 1:
            return {batch[0].trace_id: _reason(error, batch[0].trace_id)}
        results: dict[str, DiagnosedTrace | str] = {}
        for trace in batch:
            results.update(diagnose_batch(detector, [trace], history))
        return results
    partial = {trace.trace_id for trace in batch if trace.partial}
    return {trace["trace_id"]: _output(document, trace, trace["trace_id"] in partial) for trace in document["traces"]}


def _document(detector, spans: pa.Table, history: StreamHistory | None) -> dict[str, Any]:
    """The diagnosis as plain values: straight from the detector when it can (no typed objects
    built only to be serialised), else the typed diagnosis dumped (the same layout)."""
    if hasattr(detector, "diagnosis_document"):
        return detector.diagnosis_document(spans, history=history)
    return detector.diagnose(spans).model_dump()


def _output(document: dict[str, Any], trace: dict[str, Any], partial: bool) -> DiagnosedTrace:
    """Serialised straight from the plain values, with the hints `suggest` gives an anomalous
    trace (`trace_hints`: the same bytes as the typed diagnosis through `suggest`, tested)."""
    trace["partial"] = partial
    if not trace["anomalous"]:
        return DiagnosedTrace(single_trace_json(document, trace), False, False)
    trace["mitigations"] = trace_hints(trace)
    bottleneck = any(entry["bottleneck"] for entry in trace["bottlenecks"])
    return DiagnosedTrace(single_trace_json(document, trace), True, bottleneck and not partial)


def _reason(error: Exception, trace_id: str) -> str:
    if isinstance(error, TraceInputError):
        return f"invalid trace: {error}"
    log.error("diagnosing trace %s failed", trace_id, exc_info=error)
    return f"diagnosis failed: {type(error).__name__}: {error}"


@dataclass(frozen=True)
class Topics:
    diagnoses: str = "bmeg.diagnoses"
    mitigations: str = "bmeg.mitigations"
    dead_letter: str = "otlp_spans.dlq"


@dataclass
class _Send:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    future: FutureRecordMetadata | None = None
    error: Exception | None = None  # raised by `send` itself
    attempts: int = 0
    retry_at: float = 0.0


@dataclass
class Delivery:
    """The records one trace (or one unreadable message) owes; `sources` are released when all are in."""
    sources: set[Hashable]
    sends: list[_Send] = field(default_factory=list)
    diagnosed: DiagnosedTrace | None = None


@dataclass
class PublishCounts:
    """What was published, for the callers' metrics (read and reset by `take`)."""
    diagnoses: int = 0
    anomalies: int = 0
    mitigations: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    retries: int = 0

    def take(self) -> PublishCounts:
        taken = PublishCounts(self.diagnoses, self.anomalies, self.mitigations, dict(self.dead_letters), self.retries)
        self.diagnoses = self.anomalies = self.mitigations = self.retries = 0
        self.dead_letters.clear()
        return taken


def make_producer(bootstrap: str, **overrides) -> KafkaProducer:
    # One message per diagnosis: big batches spare kafka-python a network-thread wake-up per send.
    # max_block_ms bounds `send` when the broker is away (metadata, full buffer): the loop must go on.
    # The partitioner hashes a batch's trace ids at once (`Publisher.publish_all`).
    settings: dict[str, Any] = dict(bootstrap_servers=bootstrap, acks="all", linger_ms=50, batch_size=512 * 1024,
                                    max_block_ms=1_000, partitioner=BatchPartitioner())
    return KafkaProducer(**{**settings, **overrides})


def close_abandoning_unsent(producer: KafkaProducer, timeout_s: float = 1.0) -> None:
    """Close a producer within about `timeout_s`; the records it could not send by then fail
    (their sends are retried by whoever holds them)."""
    try:
        producer.close(timeout=timeout_s)
    except KafkaTimeoutError:
        # kafka-python's close() flushes first and raises when the flush times out, before the
        # step that stops its sender and fails what is left (a consumer renewing its producer
        # after a broker outage exited on this): take that step here.
        producer._sender.force_close()
        producer._sender.join(timeout_s)


class Publisher:
    def __init__(self, make_producer: Callable[[], KafkaProducer], topics: Topics, dead_letter_max_bytes: int = 256 * 1024,
                 max_attempts: int = 5, max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.make_producer = make_producer
        self.producer = make_producer()
        self.topics = topics
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.max_attempts = max_attempts
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.counts = PublishCounts()
        self._away_until = float("-inf")  # a send timed out: no more blocking sends until then

    # -- what a trace owes ---------------------------------------------------------------------
    def publish_all(self, traces: list[PendingTrace], outcomes: dict[str, DiagnosedTrace | str]) -> list[Delivery]:
        """`publish` each trace with its outcome (`diagnose_batch`'s), their keys hashed at once."""
        partitioner = self.producer.config["partitioner"]
        if isinstance(partitioner, BatchPartitioner):
            partitioner.prime([trace.trace_id.encode() for trace in traces])
        return [self.publish(trace, outcomes.get(trace.trace_id)) for trace in traces]

    def publish(self, trace: PendingTrace, outcome: DiagnosedTrace | str | None) -> Delivery:
        """Send a trace's diagnosis (and its forward to mitigation), or its dead letter."""
        delivery = Delivery(set(trace.sources))
        key = trace.trace_id.encode()
        if isinstance(outcome, DiagnosedTrace):
            delivery.diagnosed = outcome
            delivery.sends.append(self._start(_Send(self.topics.diagnoses, key, outcome.json, [])))
            if outcome.forward:
                delivery.sends.append(self._start(_Send(self.topics.mitigations, key, outcome.json, [])))
        else:
            reason = outcome or "the detector returned no diagnosis for this trace"
            delivery.sends.append(self._start(self._dead_letter(key, to_otlp_proto_bytes(trace.table()), reason,
                                                                f"trace {trace.trace_id}")))
        return delivery

    def dead_letter(self, sources: Iterable[Hashable], key: bytes | None, value: bytes, reason: str,
                    origin: str) -> Delivery:
        """Send a record that cannot be read to the dead-letter topic."""
        return Delivery(set(sources), [self._start(self._dead_letter(key, value, reason, origin))])

    def _dead_letter(self, key: bytes | None, value: bytes, reason: str, origin: str) -> _Send:
        log.warning("dead-lettered %s: %s", origin, reason)
        self.counts.dead_letters[reason.split(":")[0]] = self.counts.dead_letters.get(reason.split(":")[0], 0) + 1
        headers = [(ERROR_HEADER, reason.encode()[:4096]), (ORIGIN_HEADER, origin.encode()[:1024])]
        if len(value) > self.dead_letter_max_bytes:
            headers.append((TRUNCATED_HEADER, str(len(value)).encode()))
            value = value[:self.dead_letter_max_bytes]
        return _Send(self.topics.dead_letter, key[:1024] if key else key, value, headers)

    # -- sending and settling ------------------------------------------------------------------
    def _start(self, send: _Send) -> _Send:
        send.attempts += 1
        send.future, send.error = None, None
        if self.clock() < self._away_until:  # each send would block max_block_ms in vain: settle retries it
            send.error = KafkaTimeoutError("not sent: the broker did not answer a send just before")
            return send
        try:
            send.future = self.producer.send(send.topic, key=send.key, value=send.value, headers=send.headers)
        except KafkaError as error:  # too large, or no metadata / buffer within max_block_ms
            send.error = error
            if isinstance(error, KafkaTimeoutError):
                self._away_until = self.clock() + 1.0
        return send

    def settle(self, deliveries: list[Delivery]) -> tuple[list[Delivery], list[Delivery]]:
        """(done, still waiting): every send of a done delivery is acknowledged. Failed sends are
        replaced or retried (module docstring); raises `PublishError` when one is out of retries."""
        done, waiting = [], []
        broker_away = refused_too_large = False
        for delivery in deliveries:
            complete = True
            for send in list(delivery.sends):
                if send.future is not None and not send.future.is_done:
                    complete = False
                    continue
                error = send.error if send.future is None else send.future.exception
                if error is None:
                    continue
                complete = False
                refused_too_large |= _too_large(error)
                if _too_large(error) and len(send.value) > self.dead_letter_max_bytes:
                    delivery.sends.remove(send)
                    replacement = self._replace_too_large(send, error)
                    if replacement is not None:
                        delivery.sends.append(replacement)
                elif not broker_away and self.clock() >= send.retry_at:
                    broker_away = self._retry(send, error)
            if complete:
                self._count(delivery)
                done.append(delivery)
            else:
                waiting.append(delivery)
        if refused_too_large:
            # kafka-python's sender treats a broker's MESSAGE_TOO_LARGE as fatal and fails every later batch with it
            self.renew_producer("the broker refused a record as too large")
        return done, waiting

    def renew_producer(self, reason: str) -> None:
        """Carry on with a new producer; the records the old one had not sent fail and are sent
        again. Also after a broker outage: kafka-python's producer, which backed off reconnecting
        meanwhile, once sent nothing for two minutes after the broker was back."""
        old, self.producer = self.producer, self.make_producer()
        close_abandoning_unsent(old)
        log.warning("%s: producer renewed", reason)

    def _replace_too_large(self, send: _Send, error: Exception) -> _Send | None:
        if send.topic == self.topics.mitigations:  # its diagnosis goes to the dead-letter topic
            return None
        reason = f"diagnosis too large: {len(send.value)} bytes ({type(error).__name__})"
        return self._start(self._dead_letter(send.key, send.value, reason, f"diagnosis of {send.key!r}"))

    def _retry(self, send: _Send, error: Exception) -> bool:
        """Send again after a backoff; True when this attempt found the broker away too."""
        retriable = isinstance(error, KafkaError) and error.retriable
        if not retriable and send.attempts >= self.max_attempts:
            raise PublishError(f"publishing to {send.topic} failed {send.attempts} times: {error}")
        if send.attempts == 1 or send.attempts % 10 == 0:
            log.warning("publishing to %s failed (attempt %d, retrying): %s", send.topic, send.attempts, error)
        self.counts.retries += 1
        self._start(send)
        send.retry_at = self.clock() + min(2.0 ** min(send.attempts, 10) / 2, self.max_backoff_s)
        return isinstance(send.error, KafkaTimeoutError)

    def _count(self, delivery: Delivery) -> None:
        if delivery.diagnosed is None or any(send.topic == self.topics.dead_letter for send in delivery.sends):
            return
        self.counts.diagnoses += 1
        self.counts.anomalies += delivery.diagnosed.anomalous
        self.counts.mitigations += delivery.diagnosed.forward


def _too_large(error: Exception) -> bool:
    return isinstance(error, MessageSizeTooLargeError) or getattr(error, "errno", None) in _TOO_LARGE_ERRNOS

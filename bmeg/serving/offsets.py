"""Which Kafka offsets may be committed: only those whose every trace has been published.

A message is *open* while a trace it carried spans of is still waiting to be diagnosed and
published. Per partition the commit point is the lowest open offset (everything before it is
done), or one past the last offset received when none is open. Committing that point and no
further means a restart re-reads every message whose traces were not yet published: no loss.
Messages are received in offset order per partition (Kafka's guarantee), so each partition's
open offsets form an insertion-ordered dict and the lowest one sits at the front.

A message is named by a `Source`: its partition, its offset and the partition's *assignment*
(a count of the times it was taken away). When a rebalance takes a partition away, its
bookkeeping is forgotten and its assignment moves on, so the releases of traces still in
flight from the old assignment cannot release a message read again under a new one, and
messages polled before the rebalance are not tracked for a partition no longer owned.
A run of consecutive messages read as one (the consumer decodes a poll's OTLP protobuf messages
of a partition together) is tracked as one message at its first offset: the commit point stays
at or before its start until every trace it carried is published.

Rebalances are reported on kafka-python's network thread, so every method takes a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from typing import NamedTuple

Partition = Hashable  # kafka TopicPartition in the consumer; anything hashable in tests


class Source(NamedTuple):
    partition: Partition
    offset: int
    assignment: int


class OffsetTracker:
    def __init__(self) -> None:
        self._open: dict[Partition, dict[int, int]] = {}  # partition -> offset -> traces still pending
        self._next: dict[Partition, int] = {}  # partition -> last offset received + 1
        self._assignment: dict[Partition, int] = {}  # partition -> times taken away
        # partition -> the highest offset this process has received, kept across rebalances: a
        # message at or below it is read again (at-least-once delivery after a rebalance)
        self._read_up_to: dict[Partition, int] = {}
        self._lock = threading.Lock()

    def source(self, partition: Partition, offset: int) -> Source:
        """The name of a message under its partition's current assignment."""
        with self._lock:
            return Source(partition, offset, self._assignment.get(partition, 0))

    def received(self, source: Source, open_traces: int, last_offset: int | None = None) -> bool:
        """A message arrived carrying spans of `open_traces` traces not yet published (0: done now).
        With `last_offset`, `source` names the run of messages from its offset to that one, read
        as one (they are open, and released, together). Returns whether this process had read the
        message before, under an earlier assignment of its partition."""
        with self._lock:
            partition, offset = source.partition, source.offset
            last = offset if last_offset is None else last_offset
            read_up_to = self._read_up_to.get(partition, -1)
            self._read_up_to[partition] = max(read_up_to, last)
            if self._is_stale(source):
                return offset <= read_up_to
            if offset < self._next.get(partition, 0) or last < offset:
                raise ValueError(f"offset {offset} of {partition} received again or out of order")
            self._next[partition] = last + 1
            if open_traces > 0:
                self._open.setdefault(partition, {})[offset] = open_traces
            return offset <= read_up_to

    def release(self, source: Source) -> None:
        """One trace this message carried spans of has been published."""
        with self._lock:
            offsets = self._open.get(source.partition)
            if self._is_stale(source) or offsets is None or source.offset not in offsets:
                return
            offsets[source.offset] -= 1
            if offsets[source.offset] <= 0:
                del offsets[source.offset]

    def is_current(self, source: Source) -> bool:
        """Whether `source` was read under its partition's current assignment."""
        with self._lock:
            return not self._is_stale(source)

    def commit_points(self) -> dict[Partition, int]:
        """Per partition, the offset to commit (Kafka's convention: the next offset to read)."""
        with self._lock:
            return {
                partition: next(iter(self._open[partition]), following) if partition in self._open else following
                for partition, following in self._next.items()
            }

    def open_messages(self) -> int:
        with self._lock:
            return sum(len(offsets) for offsets in self._open.values())

    def forget(self, partitions: Iterable[Partition]) -> None:
        """Partitions taken away by a rebalance: their new owner resumes from the last commit."""
        with self._lock:
            for partition in partitions:
                self._open.pop(partition, None)
                self._next.pop(partition, None)
                self._assignment[partition] = self._assignment.get(partition, 0) + 1

    def _is_stale(self, source: Source) -> bool:
        return source.assignment != self._assignment.get(source.partition, 0)

"""Which Kafka offsets may be committed: only those whose every trace has been published.

A message is *open* while a trace it carried spans of is still waiting to be diagnosed and
published. Per partition the commit point is the lowest open offset (everything before it is
done), or one past the last offset received when none is open. Committing that point and no
further means a restart re-reads every message whose traces were not yet published: no loss.
Messages are received in offset order per partition (Kafka's guarantee), so each partition's
open offsets form an insertion-ordered dict and the lowest one sits at the front.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

Partition = Hashable  # kafka TopicPartition in the consumer; anything hashable in tests


class OffsetTracker:
    def __init__(self) -> None:
        self._open: dict[Partition, dict[int, int]] = {}  # partition -> offset -> traces still pending
        self._next: dict[Partition, int] = {}  # partition -> last offset received + 1

    def received(self, partition: Partition, offset: int, open_traces: int) -> None:
        """A message arrived carrying spans of `open_traces` traces not yet published (0: done now)."""
        if offset < self._next.get(partition, 0):
            raise ValueError(f"offset {offset} of {partition} received again or out of order")
        self._next[partition] = offset + 1
        if open_traces > 0:
            self._open.setdefault(partition, {})[offset] = open_traces

    def release(self, partition: Partition, offset: int) -> None:
        """One trace this message carried spans of has been published."""
        offsets = self._open.get(partition)
        if offsets is None or offset not in offsets:
            return  # the partition was revoked and forgotten meanwhile
        offsets[offset] -= 1
        if offsets[offset] <= 0:
            del offsets[offset]

    def commit_points(self) -> dict[Partition, int]:
        """Per partition, the offset to commit (Kafka's convention: the next offset to read)."""
        return {
            partition: next(iter(self._open[partition]), following) if partition in self._open else following
            for partition, following in self._next.items()
        }

    def open_messages(self) -> int:
        return sum(len(offsets) for offsets in self._open.values())

    def forget(self, partitions: Iterable[Partition]) -> None:
        """Partitions taken away by a rebalance: their new owner resumes from the last commit."""
        for partition in partitions:
            self._open.pop(partition, None)
            self._next.pop(partition, None)

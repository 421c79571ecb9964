"""Kafka's key partitioning, with a batch's keys hashed at once.

A keyed record goes to partition `(murmur2(key) & 0x7fffffff) % partitions` of its topic
(Java's client and kafka-python agree: records of one key, one partition). kafka-python hashes
each key in pure Python, ~5 µs a key, and the consumer publishes every diagnosis keyed by its
trace id (an anomalous one twice: diagnosis and mitigation forward). `murmur2_many` computes the
same hash for many keys in a few numpy passes (one per 4 bytes of the longest key), and
`BatchPartitioner` is kafka-python's `DefaultPartitioner` that looks a key's hash up among the
keys it was last given (`prime`) before hashing it itself: the partition chosen is the same
(tested against kafka-python's `murmur2`).
"""

from __future__ import annotations

import numpy as np
from kafka.partitioner.default import DefaultPartitioner

_SEED = 0x9747B28C
_M = np.uint32(0x5BD1E995)


def murmur2_many(keys: list[bytes]) -> list[int]:
    """kafka-python's `murmur2` of each key (unsigned 32 bits), keys of one length hashed together."""
    hashes = np.empty(len(keys), dtype=np.uint32)
    by_length: dict[int, list[int]] = {}
    for row, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(row)
    for length, rows in by_length.items():
        data = np.frombuffer(b"".join(keys[row] for row in rows), dtype=np.uint8).reshape(len(rows), length)
        hashes[rows] = _murmur2_rows(data, length)
    return hashes.tolist()


def _murmur2_rows(data: np.ndarray, length: int) -> np.ndarray:
    """The hash of each row of `data` (uint8, one key of `length` bytes per row); uint32
    arithmetic wraps as Java's int does."""
    whole = length // 4 * 4
    words = np.ascontiguousarray(data[:, :whole]).view("<u4")
    h = np.full(len(data), (_SEED ^ length) & 0xFFFFFFFF, dtype=np.uint32)
    for column in range(whole // 4):
        k = words[:, column] * _M
        k ^= k >> np.uint32(24)
        k *= _M
        h = (h * _M) ^ k
    tail = data[:, whole:].astype(np.uint32)
    extra = length - whole
    if extra >= 3:
        h ^= tail[:, 2] << np.uint32(16)
    if extra >= 2:
        h ^= tail[:, 1] << np.uint32(8)
    if extra >= 1:
        h ^= tail[:, 0]
        h *= _M
    h ^= h >> np.uint32(13)
    h *= _M
    h ^= h >> np.uint32(15)
    return h


class BatchPartitioner(DefaultPartitioner):
    """`DefaultPartitioner` with the hashes of the keys about to be sent computed at once."""

    def __init__(self) -> None:
        self._hashes: dict[bytes, int] = {}

    def prime(self, keys: list[bytes]) -> None:
        """Hash `keys` now (they replace the keys primed before: the next sends' keys)."""
        self._hashes = dict(zip(keys, murmur2_many(keys)))

    def partition(self, topic, key, serialized_key, value, serialized_value, cluster):
        hashed = self._hashes.get(serialized_key) if serialized_key is not None else None
        if hashed is None:
            return super().partition(topic, key, serialized_key, value, serialized_value, cluster)
        if topic not in cluster.topics():
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        partitions = sorted(cluster.partitions_for_topic(topic))
        return partitions[(hashed & 0x7FFFFFFF) % len(partitions)]

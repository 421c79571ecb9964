"""The consumer's partitioner sends each key where kafka-python's own would (Java's murmur2)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kafka.partitioner.default import DefaultPartitioner, murmur2

from bmeg.serving.partitioning import BatchPartitioner, murmur2_many


@given(st.lists(st.binary(max_size=70), max_size=40))
def test_the_batch_hash_is_kafkas_murmur2(keys):
    assert murmur2_many(keys) == [murmur2(key) for key in keys]


class _Metadata:
    """The three questions a partitioner asks kafka-python's `ClusterMetadata`, for one topic."""

    def __init__(self, topic: str, partitions: int):
        self.topic, self.partitions = topic, set(range(partitions))

    def topics(self) -> set[str]:
        return {self.topic}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self.partitions


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=30), st.integers(1, 12))
def test_a_primed_key_goes_to_the_partition_kafka_pythons_partitioner_picks(keys, partitions):
    metadata, ours = _Metadata("bmeg.diagnoses", partitions), BatchPartitioner()
    ours.prime(keys[::2])  # the others are hashed when sent, as kafka-python does
    for key in keys:
        assert ours.partition("bmeg.diagnoses", key, key, b"", b"", metadata) == \
            DefaultPartitioner().partition("bmeg.diagnoses", key, key, b"", b"", metadata)

"""The test Kafka broker works end to end: a message produced on a new topic comes back."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

pytestmark = pytest.mark.integration


def test_produce_then_consume_on_a_new_topic(kafka_bootstrap: str) -> None:
    topic = f"bmeg-infra-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    sent = producer.send(topic, key=b"trace-1", value=b"span payload").get(timeout=30)
    producer.close()

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        group_id=f"{topic}-reader",
        consumer_timeout_ms=20_000,
    )
    received = next(iter(consumer))
    consumer.close()

    assert (received.key, received.value) == (b"trace-1", b"span payload")
    assert received.partition == sent.partition


def test_auto_created_topics_have_several_partitions(kafka_bootstrap: str) -> None:
    topic = f"bmeg-infra-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    producer.send(topic, b"x").get(timeout=30)
    producer.close()

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    (description,) = admin.describe_topics([topic])
    admin.close()
    assert len(description["partitions"]) == 4

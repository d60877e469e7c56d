"""A user's topic as a user makes it: created and filled with confluent-kafka directly, never with kbit's producer,
JSON values with the user's own field names and keys that are not kbit's indices."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

FEATURES = 8


def bootstrap(broker: Any) -> str:
    return f"127.0.0.1:{broker.port}"


def create_user_topic(broker: Any, topic: str, partitions: int = 2, **config: str) -> None:
    client = AdminClient({"bootstrap.servers": bootstrap(broker)})
    client.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result(30)


def user_record(rng: np.random.Generator) -> dict[str, Any]:
    """A learnable record: the label says whether the readings sum above zero."""
    values = rng.normal(size=FEATURES).round(4)
    return {
        "device": {"readings": values.tolist(), "site": "north"},
        "verdict": "hot" if values.sum() > 0 else "cold",
        "seen": int(rng.integers(0, 10**9)),
    }


def fill_user_topic(
    broker: Any, topic: str, count: int, *, seed: int = 0, timestamp_ms: int | None = None, partitions: int = 2
) -> None:
    """``count`` JSON records, keyed by the user's own ids (large, unordered numbers), spread over partitions."""
    rng = np.random.default_rng(seed)
    producer = Producer({"bootstrap.servers": bootstrap(broker), "linger.ms": 5})
    for i in range(count):
        key = str(int(rng.integers(10**6, 10**9))).encode()
        extra = {"timestamp": timestamp_ms + i} if timestamp_ms is not None else {}
        producer.produce(topic, orjson.dumps(user_record(rng)), key, partition=i % partitions, **extra)
    assert producer.flush(30) == 0


def end_offsets(broker: Any, topic: str, partitions: int = 2) -> dict[int, tuple[int, int]]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap(broker), "group.id": f"probe-{time.time_ns()}"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in range(partitions)}
    finally:
        consumer.close()


USER_MAPPING: dict[str, Any] = {
    "features": ["device.readings"],
    "shape": [1, 1, FEATURES],
    "dtype": "float32",
    "label": "verdict",
}

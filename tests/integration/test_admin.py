"""Topic admin and exact end offsets against the real embedded broker (Tansu)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Producer

from kbit_core.config import DataVariant, KafkaConfig, KbitConfig
from kbit_core.errors import BrokerError, TopicError
from kbit_core.kafka import admin, contents, offsets
from kbit_core.kafka.manifest import DatasetInfo, Manifest, PartitionManifest
from tests.conftest import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]


@pytest.fixture
def kcfg(make_config: Callable[..., KbitConfig]) -> KafkaConfig:
    return make_config().kafka


@pytest.fixture
def topic(kcfg: KafkaConfig, topic_name: str) -> Iterator[str]:
    yield topic_name
    admin.delete_topic(kcfg, topic_name)


def produce_batched(kcfg: KafkaConfig, topic: str, per_partition: dict[int, int]) -> dict[int, int]:
    """Send in multi-record batches (the case Tansu's ListOffsets(LATEST) gets wrong); partition -> last offset + 1."""
    producer = Producer({"bootstrap.servers": kcfg.resolved_bootstrap(), "linger.ms": 50, "acks": "all"})
    ends: dict[int, int] = {}

    def on_delivery(err, msg) -> None:
        assert err is None, err
        ends[msg.partition()] = max(ends.get(msg.partition(), 0), msg.offset() + 1)

    for partition, count in per_partition.items():
        for i in range(count):
            producer.produce(topic, value=b"v%d" % i, partition=partition, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    return ends


def manifest_for(topic: str, messages: dict[int, int]) -> Manifest:
    parts = [
        PartitionManifest(
            partition=p, first_offset=0, last_offset=n - 1, num_messages=n, num_records=n, value_bytes=2 * n
        )
        for p, n in sorted(messages.items())
    ]
    total = sum(messages.values())
    return Manifest(
        topic=topic,
        dataset=DatasetInfo(
            name="synthetic_digits", seed=0, num_records=total, image_shape=(1, 28, 28), num_classes=10
        ),
        variant=DataVariant(),
        schema_fingerprint="f",
        partitions=parts,
        num_messages=total,
        num_records=total,
        value_bytes=2 * total,
        produce_seconds=0.1,
        client="confluent",
        kbit_version="test",
    )


def test_create_list_describe_delete(kcfg: KafkaConfig, topic: str) -> None:
    admin.create_topic(kcfg, topic, 3)
    assert topic in admin.list_topics(kcfg)
    assert admin.topic_exists(kcfg, topic)
    assert admin.topic_partitions(kcfg, topic) == [0, 1, 2]
    with pytest.raises(TopicError, match=f"topic '{topic}' already exists"):
        admin.create_topic(kcfg, topic, 3)
    assert admin.delete_topic(kcfg, topic) is True
    assert not admin.topic_exists(kcfg, topic)
    assert admin.delete_topic(kcfg, topic) is False
    admin.create_topic(kcfg, topic, 1)  # the name is free again right after the deletion
    assert admin.topic_partitions(kcfg, topic) == [0]


def test_missing_topic_is_named(kcfg: KafkaConfig, topic_name: str) -> None:
    with pytest.raises(TopicError, match=f"topic '{topic_name}' does not exist on the embedded broker"):
        admin.topic_partitions(kcfg, topic_name)
    with pytest.raises(TopicError, match=topic_name):
        offsets.exact_end_offsets(kcfg, topic_name)


def test_exact_end_offsets_match_delivered_offsets(kcfg: KafkaConfig, topic: str) -> None:
    admin.create_topic(kcfg, topic, 3)
    delivered = produce_batched(kcfg, topic, {0: 500, 1: 37})
    assert offsets.exact_end_offsets(kcfg, topic) == {0: delivered[0], 1: delivered[1], 2: 0}
    assert offsets.exact_end_offsets(kcfg, topic, [1]) == {1: 37}
    assert offsets.earliest_offsets(kcfg, topic) == {0: 0, 1: 0, 2: 0}
    with pytest.raises(TopicError, match=r"has no partition\(s\) \[5\]"):
        offsets.exact_end_offsets(kcfg, topic, [0, 5])


def test_check_topic_accepts_exactly_the_manifest(kcfg: KafkaConfig, topic: str) -> None:
    admin.create_topic(kcfg, topic, 2)
    produce_batched(kcfg, topic, {0: 20, 1: 19})
    check = contents.check_topic(kcfg, manifest_for(topic, {0: 20, 1: 19}))
    assert check.holds_manifest and check.ends == {0: 20, 1: 19} and check.partitions == [0, 1]

    appended = contents.check_topic(kcfg, manifest_for(topic, {0: 20, 1: 18}))
    assert appended.problems == ["partition 1: the broker ends at offset 19, the manifest at 18"]
    assert appended.differing == {1}

    wider = contents.check_topic(kcfg, manifest_for(topic, {0: 20, 1: 19, 2: 5}))
    assert wider.problems == ["partitions: the broker has [0, 1], the manifest has [0, 1, 2]"]
    assert wider.differing == {2}


def test_check_topic_reports_a_vanished_topic(kcfg: KafkaConfig, topic_name: str) -> None:
    check = contents.check_topic(kcfg, manifest_for(topic_name, {0: 1}))
    assert not check.exists and not check.holds_manifest
    assert "does not exist" in check.problems[0] and check.differing == {0}


def test_embedded_broker_down_fails_at_once_naming_it() -> None:
    kcfg = KafkaConfig(embedded={"port": free_port()})
    started = time.monotonic()
    with pytest.raises(BrokerError, match=rf"embedded broker 127.0.0.1:{kcfg.embedded.port}.*kbit stack up"):
        admin.list_topics(kcfg)
    assert time.monotonic() - started < 5  # a hang would take minutes; leave room for a loaded CI box


def test_unreachable_cluster_fails_within_seconds_naming_it() -> None:
    bootstrap = f"127.0.0.1:{free_port()}"
    kcfg = KafkaConfig(bootstrap_servers=bootstrap, request_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(BrokerError, match=f"Kafka cluster at {bootstrap}"):
        admin.topic_partitions(kcfg, "anything")
    assert time.monotonic() - started < 10  # request_timeout_s=1 plus retries, far from a hang

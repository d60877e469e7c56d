"""produce_dataset against the real embedded broker: exact manifests (read back), reuse, mismatch, recreate."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kbit_core import produce
from kbit_core.config import DataVariant, KafkaConfig, KbitConfig
from kbit_core.datasets import open_source
from kbit_core.errors import BrokerError, ManifestMismatchError
from kbit_core.formats import get_codec
from kbit_core.kafka import admin
from kbit_core.kafka.apache_broker import ApacheKafkaBroker
from kbit_core.kafka.broker import EmbeddedBroker
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.kafka.producers import BACKENDS, DeliveryLedger, make_producer
from kbit_core.produce import ensure_topics, produce_dataset
from tasks.produce import topic_identity_key
from tests.conftest import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]


@pytest.fixture
def cfg(make_config: Callable[..., KbitConfig], topic_name: str) -> Iterator[KbitConfig]:
    config = make_config(dataset__num_records=23, produce__partitions=3, produce__topic=topic_name)
    yield config
    admin.delete_topic(config.kafka, topic_name)


def read_back(kcfg: KafkaConfig, manifest: Manifest) -> list[tuple[int, int, bytes, bytes]]:
    """Every message in the manifest's ranges as (partition, offset, key, value), with a plain consumer."""
    consumer = Consumer(
        {"bootstrap.servers": kcfg.resolved_bootstrap(), "group.id": "test-read-back", "enable.auto.commit": False}
    )
    ranges = {p: r for p, r in manifest.ranges().items() if r[1] > r[0]}
    consumer.assign([TopicPartition(manifest.topic, p, start) for p, (start, _) in ranges.items()])
    out: list[tuple[int, int, bytes, bytes]] = []
    deadline = time.monotonic() + 20
    while len(out) < manifest.num_messages and time.monotonic() < deadline:
        for msg in consumer.consume(500, 0.2):
            assert msg.error() is None, msg.error()
            if msg.offset() < ranges[msg.partition()][1]:
                out.append((msg.partition(), msg.offset(), msg.key(), msg.value()))
    consumer.close()
    return sorted(out)


def assert_topic_holds_dataset(cfg: KbitConfig, manifest: Manifest) -> None:
    """The manifest is exact: message m (key = its first index) sits in partition m % P, and decodes to the source."""
    variant, per_message = manifest.variant, manifest.variant.records_per_message
    source = open_source(cfg.dataset)
    codec = get_codec(variant.format, variant.layout, source.image_shape, per_message, num_classes=source.num_classes)
    messages = read_back(cfg.kafka, manifest)
    assert len(messages) == manifest.num_messages == -(-source.num_records // per_message)
    assert admin.exact_end_offsets(cfg.kafka, manifest.topic) == {p: r[1] for p, r in manifest.ranges().items()}
    by_first_index = {int(key): (partition, value) for partition, _, key, value in messages}
    indices, images, labels = next(source.batches(0, source.num_records, source.num_records))
    for m in range(manifest.num_messages):
        partition, value = by_first_index[m * per_message]
        assert partition == m % cfg.produce.partitions
        decoded = codec.decode([value])
        sl = slice(m * per_message, (m + 1) * per_message)
        np.testing.assert_array_equal(decoded.indices, indices[sl])
        np.testing.assert_array_equal(decoded.labels, labels[sl])
        expected = images[sl] if variant.layout == "bytes" else images[sl].astype(np.float32) / 255
        np.testing.assert_allclose(decoded.pixels, expected, atol=1e-6)
    for p in manifest.partitions:
        in_partition = [v for part, _, _, v in messages if part == p.partition]
        assert p.num_messages == len(in_partition) and p.value_bytes == sum(map(len, in_partition))
    assert sum(p.num_records for p in manifest.partitions) == manifest.num_records == source.num_records


@pytest.mark.parametrize(
    "variant",
    [
        DataVariant(format="json", layout="list", compression="none"),
        DataVariant(format="avro", layout="list", compression="lz4", records_per_message=4),
        DataVariant(format="protobuf", layout="bytes", compression="gzip"),
        DataVariant(format="bson", layout="bytes", compression="snappy", records_per_message=5),
        DataVariant(format="raw", layout="bytes", compression="zstd"),
    ],
    ids=lambda v: v.name,
)
def test_each_compression_produces_an_exact_manifest(cfg: KbitConfig, variant: DataVariant) -> None:
    cfg.produce.variant = variant
    manifest = produce_dataset(cfg, progress=False)
    assert manifest.variant == variant and manifest.client == "confluent"
    assert manifest.wire_bytes is not None and manifest.wire_bytes > 0
    assert manifest.dataset.num_records == 23 and manifest.dropped_records == 0
    assert Manifest.load(manifest_path(cfg.workdir, manifest.topic)) == manifest
    assert_topic_holds_dataset(cfg, manifest)


def test_kafka_python_backend_produces_the_same_layout(cfg: KbitConfig) -> None:
    cfg.produce.variant = DataVariant(format="mongodb_avro", layout="list", compression="lz4")
    manifest = produce_dataset(cfg, progress=False, client="kafka-python")
    assert manifest.client == "kafka-python" and manifest.wire_bytes
    assert_topic_holds_dataset(cfg, manifest)


def test_matching_topic_is_reused_without_producing(cfg: KbitConfig) -> None:
    first = produce_dataset(cfg, progress=False)
    again = produce_dataset(cfg, progress=False)
    assert again == first  # same created_at: loaded, not produced again
    assert admin.exact_end_offsets(cfg.kafka, cfg.produce.topic) == {p: r[1] for p, r in first.ranges().items()}


def test_different_request_raises_mismatch_until_recreate(cfg: KbitConfig) -> None:
    produce_dataset(cfg, progress=False)
    cfg.produce.variant = DataVariant(format="avro", layout="list", compression="none")
    cfg.dataset.seed = 5
    with pytest.raises(ManifestMismatchError) as err:
        produce_dataset(cfg, progress=False)
    assert "dataset.seed: 0 != 5" in str(err.value) and "variant.compression: 'lz4' != 'none'" in str(err.value)
    recreated = produce_dataset(cfg, progress=False, recreate=True)
    assert recreated.variant.compression == "none" and recreated.dataset.seed == 5
    assert_topic_holds_dataset(cfg, recreated)


def test_foreign_topic_without_manifest_is_not_overwritten(cfg: KbitConfig) -> None:
    admin.create_topic(cfg.kafka, cfg.produce.topic, 3)
    with pytest.raises(ManifestMismatchError, match="exists but has no manifest"):
        produce_dataset(cfg, progress=False)
    assert_topic_holds_dataset(cfg, produce_dataset(cfg, progress=False, recreate=True))


def test_appended_messages_break_reuse(cfg: KbitConfig) -> None:
    produce_dataset(cfg, progress=False)
    extra = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    extra.produce(cfg.produce.topic, value=b"stray", partition=1)
    assert extra.flush(10) == 0
    with pytest.raises(ManifestMismatchError, match="partition 1: the broker ends at offset 9, the manifest at 8"):
        produce_dataset(cfg, progress=False)


def test_vanished_topic_is_produced_again(cfg: KbitConfig, caplog: pytest.LogCaptureFixture) -> None:
    first = produce_dataset(cfg, progress=False)
    admin.delete_topic(cfg.kafka, cfg.produce.topic)  # what an embedded-broker restart does
    with caplog.at_level(logging.WARNING, logger="kbit_core.produce"):
        again = produce_dataset(cfg, progress=False)
    assert "is gone" in caplog.text and "producing it again" in caplog.text
    assert again.created_at > first.created_at and again.ranges() == first.ranges()
    assert_topic_holds_dataset(cfg, again)


def test_stale_manifest_of_a_vanished_topic_does_not_block_producing(cfg: KbitConfig) -> None:
    """A manifest left behind by a restarted broker describes no data, so a changed request just produces."""
    produce_dataset(cfg, progress=False)
    admin.delete_topic(cfg.kafka, cfg.produce.topic)
    stale = Manifest.load(manifest_path(cfg.workdir, cfg.produce.topic))
    stale.model_copy(update={"schema_fingerprint": "0" * 64}).save(cfg.manifest_dir)
    again = produce_dataset(cfg, progress=False)
    assert again.schema_fingerprint != "0" * 64
    assert_topic_holds_dataset(cfg, again)


def test_ensure_topics_produces_each_variant_under_its_own_name(make_config: Callable[..., KbitConfig]) -> None:
    cfg = make_config(dataset__num_records=7, produce__partitions=2)
    variants = [DataVariant(format="raw", layout="bytes", compression=c) for c in ("none", "lz4")]
    manifests = ensure_topics(cfg, variants, progress=False)
    try:
        assert [m.topic for m in manifests] == [cfg.produce.topic_for(cfg.dataset, v) for v in variants]
        assert len(set(m.topic for m in manifests)) == 2
        assert ensure_topics(cfg, variants, progress=False) == manifests
    finally:
        for m in manifests:
            admin.delete_topic(cfg.kafka, m.topic)


@pytest.mark.parametrize("client", sorted(BACKENDS))
def test_delivery_failure_names_topic_and_partition(cfg: KbitConfig, client: str) -> None:
    topic = cfg.produce.topic
    admin.create_topic(cfg.kafka, topic, 1)
    backend = make_producer(cfg.kafka, cfg.produce, "lz4", client)
    ledger = DeliveryLedger(topic, 3)
    try:
        with pytest.raises(BrokerError, match=rf"{topic}\[2\]"):
            backend.send(topic, 0, b"0", b"fine", ledger.callback(1, 4))
            backend.send(topic, 2, b"1", b"no such partition", ledger.callback(1, 17))
            backend.flush(10)
            ledger.partitions()
    finally:
        backend.close()


def test_broker_down_raises_quickly_naming_it(make_config: Callable[..., KbitConfig]) -> None:
    cfg = make_config(kafka__embedded__port=free_port(), dataset__num_records=5)
    started = time.monotonic()
    with pytest.raises(BrokerError, match=f"127.0.0.1:{cfg.kafka.embedded.port}.*kbit stack up"):
        produce_dataset(cfg, progress=False)
    assert time.monotonic() - started < 10


@pytest.mark.own_broker
def test_embedded_broker_restart_reproduces_the_lost_topic(
    make_config: Callable[..., KbitConfig], tmp_path: Path
) -> None:
    """The real case behind the vanished-topic rule: Tansu keeps topics in memory only."""
    own = EmbeddedBroker(tmp_path / "own-broker", port=free_port())
    own.start()
    try:
        cfg = make_config(kafka__embedded__port=own.port, kafka__embedded__broker="tansu", dataset__num_records=9)
        first = produce_dataset(cfg, progress=False)
        own.stop()
        own.start()
        assert not admin.topic_exists(cfg.kafka, first.topic)
        again = produce_dataset(cfg, progress=False)
        assert again.created_at > first.created_at and again.ranges() == first.ranges()
        assert admin.check_topic(cfg.kafka, again).holds_manifest
    finally:
        own.stop()


@pytest.mark.own_broker
def test_apache_kafka_keeps_the_topic_across_a_restart_and_it_is_not_produced_again(
    make_config: Callable[..., KbitConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, apache_kafka: object
) -> None:
    """Apache Kafka keeps its data on disk: after a restart (disk kept) the topic and its offsets are still there,
    a second produce of the same dataset reuses the manifest instead of producing again, and the flow's topic
    cache key (no broker PID on Apache Kafka) does not change."""
    own = ApacheKafkaBroker(tmp_path / "own-broker", port=free_port(), controller_port=free_port())
    own.start()
    try:
        cfg = make_config(
            kafka={"embedded": {"port": own.port, "broker": "apache-kafka", "controller_port": own.controller_port}},
            dataset__num_records=9,
            produce__partitions=2,
        )
        first = produce_dataset(cfg, progress=False)
        key = topic_identity_key(None, {"cfg": cfg, "variants": None})  # type: ignore[arg-type]
        own.stop()
        own.start()
        assert admin.topic_exists(cfg.kafka, first.topic)
        assert admin.exact_end_offsets(cfg.kafka, first.topic) == {p: r[1] for p, r in first.ranges().items()}

        def produced_again(*args: object, **kwargs: object) -> None:
            raise AssertionError("the topic was produced again after a restart that kept it")

        monkeypatch.setattr(produce, "_produce", produced_again)
        again = produce_dataset(cfg, progress=False)
        assert again.created_at == first.created_at and again.ranges() == first.ranges()
        assert admin.check_topic(cfg.kafka, again).holds_manifest
        assert topic_identity_key(None, {"cfg": cfg, "variants": None}) == key  # type: ignore[arg-type]
    finally:
        own.stop()

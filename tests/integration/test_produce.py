"""produce_dataset against the real embedded broker: exact manifests (read back), reuse, mismatch, recreate."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from typer.testing import CliRunner

from kbit_core import produce
from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.cli import app
from kbit_core.config import DataVariant, KafkaConfig, KbitConfig
from kbit_core.datasets import open_source
from kbit_core.errors import BrokerError, ConfigError, ManifestMismatchError, TopicError
from kbit_core.formats import get_codec
from kbit_core.kafka import admin, contents, offsets
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
    assert offsets.exact_end_offsets(cfg.kafka, manifest.topic) == {p: r[1] for p, r in manifest.ranges().items()}
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


def test_matching_topic_is_reused_without_producing(cfg: KbitConfig, caplog: pytest.LogCaptureFixture) -> None:
    first = produce_dataset(cfg, progress=False)
    again = produce_dataset(cfg, progress=False)
    assert again == first  # same created_at: loaded, not produced again
    assert offsets.exact_end_offsets(cfg.kafka, cfg.produce.topic) == {p: r[1] for p, r in first.ranges().items()}
    # The records were read and found exact once: while the topic's id and offsets stay, they are not read again
    with caplog.at_level(logging.INFO, logger="kbit_core.kafka.contents"):
        assert produce_dataset(cfg, progress=False) == first
    assert "records verified before" in caplog.text


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


def test_foreign_topic_without_manifest_is_neither_overwritten_nor_recreated(cfg: KbitConfig) -> None:
    """Issue 31: --recreate deleted a user's topic kbit had not created; now neither path touches it."""
    admin.create_topic(cfg.kafka, cfg.produce.topic, 3)
    for recreate in (False, True):
        with pytest.raises(TopicError, match="exists and kbit did not create it") as exc:
            produce_dataset(cfg, progress=False, recreate=recreate)
        assert "--recreate" not in str(exc.value) and f"source.topic={cfg.produce.topic}" in str(exc.value)
    assert admin.topic_partitions(cfg.kafka, cfg.produce.topic) == [0, 1, 2]
    assert not manifest_path(cfg.workdir, cfg.produce.topic).exists()


def test_changed_records_at_unchanged_offsets_break_reuse_and_inspect(cfg: KbitConfig, tmp_path: Path) -> None:
    """Issue 21 defect 4: drop one record and duplicate another, so every offset still matches the manifest."""
    manifest = produce_dataset(cfg, progress=False)
    assert produce_dataset(cfg, progress=False) == manifest  # a reuse that found the records exact, remembered
    messages = read_back(cfg.kafka, manifest)
    in_partition_1 = [m for m in messages if m[0] == 1]
    tampered = [m for m in messages if m not in in_partition_1]
    tampered += in_partition_1[:2] + in_partition_1[3:] + in_partition_1[-1:]  # offset 2 dropped, the last repeated
    admin.delete_topic(cfg.kafka, cfg.produce.topic)
    admin.create_topic(cfg.kafka, cfg.produce.topic, 3)
    writer = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap(), "enable.idempotence": True})
    for partition, _, key, value in tampered:
        writer.produce(cfg.produce.topic, value=value, key=key, partition=partition)
    assert writer.flush(10) == 0
    assert contents.check_topic(cfg.kafka, manifest).holds_manifest  # the offsets alone cannot tell

    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(cfg.to_dict()))
    result = CliRunner().invoke(app, ["inspect", cfg.produce.topic, "--json", "--config", str(profile)])
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert problems == [
        "partition 1: the records differ from the manifest's (offset 2 holds the message of record 10, where the "
        "manifest has record 7)"
    ]
    with pytest.raises(ManifestMismatchError, match="partition 1: the records differ"):
        produce_dataset(cfg, progress=False)
    assert_topic_holds_dataset(cfg, produce_dataset(cfg, progress=False, recreate=True))


def test_a_message_over_the_size_limits_is_refused_before_the_topic_is_created(
    make_config: Callable[..., KbitConfig], topic_name: str
) -> None:
    """Issue 21 defect 5: 1,600 raw records of 784 bytes in one message failed at the broker, leaving an empty topic."""
    big = {"format": "raw", "layout": "bytes", "compression": "lz4", "records_per_message": 1600}
    cfg = make_config(dataset__num_records=1600, produce__topic=topic_name, produce__variant=big)
    with pytest.raises(
        ConfigError,
        match=r"records_per_message=1600: one raw_bytes_lz4_x1600 message is 1,270,542 bytes "
        r"\(uncompressed\), over the confluent producer's message size limit \(1,000,000 bytes\); "
        r"use at most about 1259 records per message",
    ):
        produce_dataset(cfg, progress=False)
    assert not admin.topic_exists(cfg.kafka, topic_name)
    roomy_client = cfg.override({"kafka.extra": {"message.max.bytes": 4_000_000}})
    if not cfg.kafka.tansu:  # Tansu does not tell its limit
        with pytest.raises(ConfigError, match=r"over the max.message.bytes of the embedded broker 127.0.0.1:\d+ "):
            produce_dataset(roomy_client, progress=False)
        assert not admin.topic_exists(cfg.kafka, topic_name)


def test_another_workdir_finds_the_topic_and_recreate_says_whose_it_deletes(
    cfg: KbitConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 21 defect 2: the same dataset asked for from a second workdir (a deployment's `.kbit` and the CLI's
    `.kbit/bench-smoke`) stopped with "exists but has no manifest", and its advice --recreate deletes the first's."""
    first = produce_dataset(cfg, progress=False)
    other = cfg.override({"workdir": str(tmp_path / "other")})
    adopted = produce_dataset(other, progress=False)
    assert adopted == first and manifest_path(other.workdir, cfg.produce.topic).is_file()

    different = cfg.override({"workdir": str(tmp_path / "third"), "dataset.seed": 9})
    with pytest.raises(ManifestMismatchError) as mismatch:
        produce_dataset(different, progress=False)
    message = str(mismatch.value)
    assert f"recorded in kbit.manifests by {socket.gethostname()}:{cfg.run_dir}" in message
    assert "set produce.topic to keep this dataset apart" in message and "dataset.seed: 0 != 9" in message

    with caplog.at_level(logging.WARNING, logger="kbit_core.produce"):
        produce_dataset(different, progress=False, recreate=True)
    assert f"--recreate deletes topic {cfg.produce.topic}, which {socket.gethostname()}:{cfg.run_dir} produced" in (
        caplog.text
    )
    with pytest.raises(ManifestMismatchError, match=r"(?s)by .*third\) differs .*dataset.seed: 9 != 0"):  # told of it
        produce_dataset(cfg, progress=False)


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
        assert contents.check_topic(cfg.kafka, again).holds_manifest
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
        assert offsets.exact_end_offsets(cfg.kafka, first.topic) == {p: r[1] for p, r in first.ranges().items()}

        def produced_again(*args: object, **kwargs: object) -> None:
            raise AssertionError("the topic was produced again after a restart that kept it")

        monkeypatch.setattr(produce, "_produce", produced_again)
        again = produce_dataset(cfg, progress=False)
        assert again.created_at == first.created_at and again.ranges() == first.ranges()
        assert contents.check_topic(cfg.kafka, again).holds_manifest
        assert topic_identity_key(None, {"cfg": cfg, "variants": None}) == key  # type: ignore[arg-type]
    finally:
        own.stop()


@pytest.mark.own_broker
@pytest.mark.slow
def test_a_broker_lost_mid_produce_is_named_within_seconds_and_the_rerun_needs_no_recreate(
    make_config: Callable[..., KbitConfig],
    tmp_path: Path,
    apache_kafka: object,
    record_property: Callable[[str, object], None],
    topic_name: str,
) -> None:
    """Issue 21 defect 3: a broker killed during `kbit produce` went unreported for 120 s (the delivery timeout),
    the error named counts rather than the broker, and the rerun demanded --recreate for the partial topic."""
    own = ApacheKafkaBroker(tmp_path / "own-broker", port=free_port(), controller_port=free_port())
    own.start()
    try:
        cfg = make_config(
            kafka={"embedded": {"port": own.port, "broker": "apache-kafka", "controller_port": own.controller_port}},
            dataset__num_records=400_000,
            produce__topic=topic_name,
            produce__variant={"format": "json", "layout": "list", "compression": "none"},
        )
        outcome: dict[str, object] = {}

        def produce_until_it_fails() -> None:
            try:
                produce_dataset(cfg, progress=False)
            except BrokerError as exc:
                outcome["error"], outcome["at"] = str(exc), time.monotonic()

        producing = threading.Thread(target=produce_until_it_fails)
        producing.start()
        deadline = time.monotonic() + 60
        while not admin.topic_exists(cfg.kafka, cfg.produce.topic) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # into the produce
        os.kill(own.status().pid, signal.SIGKILL)
        killed = time.monotonic()
        producing.join(timeout=150)
        assert not producing.is_alive() and "error" in outcome, "the produce did not fail on the lost broker"
        record_property("seconds", round(float(outcome["at"]) - killed, 2))  # type: ignore[arg-type]
        assert re.search(
            rf"cannot reach the embedded broker 127\.0\.0\.1:{own.port}.*: lost while producing, down for \d+ s "
            rf"\(.*127\.0\.0\.1:{own.port}.*Connection refused",
            str(outcome["error"]),
        ), outcome["error"]

        own.start()  # its disk kept the partial topic
        assert admin.topic_exists(cfg.kafka, cfg.produce.topic)
        small = cfg.override({"dataset.num_records": 40})
        again = produce_dataset(small, progress=False)  # no --recreate asked for
        assert again.num_records == 40 and contents.check_topic(small.kafka, again).holds_manifest
    finally:
        own.stop()

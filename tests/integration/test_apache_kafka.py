"""kbit's Kafka layer against a real Apache Kafka 4.x broker (one KRaft node from the pinned jars): both clients,
every codec, exact offset ranges, exact ListOffsets(LATEST), idempotent acks=all producers, data kept across a
restart, what kafka-python cannot do against 4.x (KIP-896), and kbit's own produce and read paths.

The broker is the session fixture ``apache_kafka`` (tests/conftest.py); configs reach it as an external cluster
(``kafka.bootstrap_servers``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from kbit_core.brokers.apache_broker import ApacheKafkaBroker, kafka_version
from kbit_core.config import DataVariant, KafkaConfig, KbitConfig, ProduceConfig, ReaderConfig
from kbit_core.data.reader import RangeReader
from kbit_core.errors import OffsetRangeError
from kbit_core.formats import get_codec
from kbit_core.kafka import admin, contents, offsets, tansu
from kbit_core.kafka.consumers import RawRecord, make_consumer
from kbit_core.kafka.producers import make_producer
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange

pytestmark = pytest.mark.kafka

CLIENTS = ["confluent", "kafka-python"]
CODECS = ["none", "gzip", "lz4", "snappy", "zstd"]


@pytest.fixture
def kcfg(apache_kafka: ApacheKafkaBroker) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=apache_kafka.bootstrap)


@pytest.fixture
def topic(kcfg: KafkaConfig) -> Iterator[str]:
    name = f"ak-{uuid.uuid4().hex[:10]}"
    yield name
    admin.delete_topic(kcfg, name)


def value(i: int) -> bytes:
    return f"record-{i:06d}:".encode() + bytes([i % 251]) * 300


def produce(
    kcfg: KafkaConfig,
    topic: str,
    partitions: int,
    count: int,
    compression: str = "none",
    client: str = "confluent",
    start: int = 0,
    linger_ms: int = 50,
) -> dict[int, tuple[int, int]]:
    """Send records start..start+count-1 (record i to partition i % partitions) with kbit's producer backend
    (acks=all, idempotent); record i -> (partition, offset) from the delivery reports."""
    producer = make_producer(kcfg, ProduceConfig(linger_ms=linger_ms), compression, client)  # type: ignore[arg-type]
    delivered: dict[int, tuple[int, int]] = {}
    errors: list[str] = []

    def report(i: int) -> Callable[[int, int, str | None], None]:
        return lambda p, o, err: errors.append(err) if err else delivered.__setitem__(i, (p, o))

    try:
        for i in range(start, start + count):
            producer.send(topic, i % partitions, str(i).encode(), value(i), report(i))
        producer.flush(60)
    finally:
        producer.close()
    assert not errors, errors[:3]
    assert len(delivered) == count
    return delivered


def listed_latest(kcfg: KafkaConfig, topic: str, partitions: int) -> dict[int, int]:
    """ListOffsets(LATEST) as the broker answers it, uncached (what Tansu answers short)."""
    consumer = Consumer({"bootstrap.servers": kcfg.resolved_bootstrap(), "group.id": "ak-list-offsets"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in range(partitions)
        }
    finally:
        consumer.close()


def kafka_python_latest(kcfg: KafkaConfig, topic: str, partitions: int) -> dict[int, int]:
    import kafka

    consumer = kafka.KafkaConsumer(bootstrap_servers=kcfg.resolved_bootstrap(), group_id=None)
    try:
        ends = consumer.end_offsets([kafka.TopicPartition(topic, p) for p in range(partitions)])
        return {tp.partition: end for tp, end in ends.items()}
    finally:
        consumer.close()


def read_ranges(kcfg: KafkaConfig, client: str, topic: str, ranges: dict[int, tuple[int, int]]) -> list[RawRecord]:
    """Records in [start, stop) of each partition through kbit's consumer backend (assign + seek, no group)."""
    out: list[RawRecord] = []
    with make_consumer(kcfg, ReaderConfig(), client) as consumer:  # type: ignore[arg-type]
        consumer.assign(topic, {p: start for p, (start, _) in ranges.items()})
        deadline = time.monotonic() + 30
        want = sum(stop - start for start, stop in ranges.values())
        while len(out) < want and time.monotonic() < deadline:
            out += [r for r in consumer.poll(500, 0.2) if r.offset < ranges[r.partition][1]]
    return sorted(out)


def expected_records(delivered: dict[int, tuple[int, int]], ranges: dict[int, tuple[int, int]]) -> list[RawRecord]:
    return sorted(RawRecord(p, o, value(i)) for i, (p, o) in delivered.items() if ranges[p][0] <= o < ranges[p][1])


def test_broker_is_a_local_kraft_node(apache_kafka: ApacheKafkaBroker, kcfg: KafkaConfig) -> None:
    status = apache_kafka.status()
    assert status.running and status.pid is not None and status.bootstrap == apache_kafka.bootstrap
    assert apache_kafka.version() == f"apache-kafka {kafka_version()}" and kafka_version().startswith("4.")
    props = apache_kafka.properties()
    assert props["process.roles"] == "broker,controller"
    assert all(url.split("://")[1].startswith("127.0.0.1:") for url in props["listeners"].split(","))
    assert (apache_kafka.data_dir / "meta.properties").is_file()
    assert apache_kafka.cluster_id() in (apache_kafka.data_dir / "meta.properties").read_text()
    assert "Kafka Server started" in apache_kafka.server_log_path.read_text()


@pytest.mark.parametrize("compression", CODECS)
@pytest.mark.parametrize("client", CLIENTS)
def test_every_codec_exact_ranges_and_exact_end_offsets(
    kcfg: KafkaConfig, topic: str, client: str, compression: str
) -> None:
    admin.create_topic(kcfg, topic, 3)
    delivered = produce(kcfg, topic, 3, 300, compression, client)
    for p in range(3):
        assert sorted(o for q, o in delivered.values() if q == p) == list(range(100))
    # ListOffsets(LATEST) is exact on Apache Kafka (batches of many records: Tansu answers these short), and agrees
    # with kbit's fetch-probe and with kafka-python's
    ends = {p: 100 for p in range(3)}
    assert listed_latest(kcfg, topic, 3) == ends
    assert kafka_python_latest(kcfg, topic, 3) == ends
    assert offsets.exact_end_offsets(kcfg, topic) == ends
    assert offsets.earliest_offsets(kcfg, topic) == {p: 0 for p in range(3)}
    ranges = {0: (0, 100), 1: (30, 70), 2: (99, 100)}
    for reader in CLIENTS:
        assert read_ranges(kcfg, reader, topic, ranges) == expected_records(delivered, ranges), reader


def test_list_offsets_latest_needs_no_fetch_probe(kcfg: KafkaConfig, topic: str) -> None:
    """Thousands of small records in few batches: ListOffsets(LATEST) is the log end, the bounds a Fetch reports."""
    admin.create_topic(kcfg, topic, 1)
    produce(kcfg, topic, 1, 5000, "zstd", linger_ms=100)
    assert listed_latest(kcfg, topic, 1) == {0: 5000}
    consumer = offsets._offset_consumer(kcfg)
    try:
        assert tansu.fetch_bounds(consumer, kcfg, topic, {0: 0}) == {0: (0, 5000)}
        assert tansu.fetch_bounds(consumer, kcfg, topic, {0: 4999}) == {0: (0, 5000)}
    finally:
        consumer.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_idempotent_producer_with_acks_all(kcfg: KafkaConfig, topic: str, client: str) -> None:
    """kbit's producers are idempotent with acks=all: the broker tracks their producer id and sequence numbers."""
    import kafka

    admin.create_topic(kcfg, topic, 2)
    delivered = produce(kcfg, topic, 2, 400, "lz4", client)
    assert sorted(delivered.values()) == [(p, o) for p in range(2) for o in range(200)]
    client_admin = kafka.KafkaAdminClient(bootstrap_servers=kcfg.resolved_bootstrap())
    try:
        states = client_admin.describe_producers([kafka.TopicPartition(topic, p) for p in (0, 1)])
    finally:
        client_admin.close()
    for p in (0, 1):
        (state,) = states[kafka.TopicPartition(topic, p)].active_producers
        assert state.producer_id >= 0 and state.last_sequence == 199, state


def test_restart_keeps_topics_and_data(apache_kafka: ApacheKafkaBroker, kcfg: KafkaConfig, topic: str) -> None:
    admin.create_topic(kcfg, topic, 2)
    delivered = produce(kcfg, topic, 2, 200, "zstd")
    assert apache_kafka.stop()
    assert not apache_kafka.status().running
    apache_kafka.start()
    assert admin.topic_partitions(kcfg, topic) == [0, 1]
    assert listed_latest(kcfg, topic, 2) == offsets.exact_end_offsets(kcfg, topic) == {0: 100, 1: 100}
    ranges = {0: (0, 100), 1: (0, 100)}
    for reader in CLIENTS:
        assert read_ranges(kcfg, reader, topic, ranges) == expected_records(delivered, ranges), reader
    more = produce(kcfg, topic, 2, 20, "zstd", start=200)
    assert sorted(more.values()) == [(p, o) for p in range(2) for o in range(100, 110)]


@pytest.mark.parametrize("client", CLIENTS)
def test_consumer_group_subscribe_and_commit(kcfg: KafkaConfig, topic: str, client: str) -> None:
    admin.create_topic(kcfg, topic, 2)
    produce(kcfg, topic, 2, 40)
    group = f"ak-group-{uuid.uuid4().hex[:6]}"
    started, seen = time.monotonic(), 0
    if client == "confluent":
        consumer = Consumer(
            {
                "bootstrap.servers": kcfg.resolved_bootstrap(),
                "group.id": group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        consumer.subscribe([topic])
        while seen < 40 and time.monotonic() - started < 30:
            seen += sum(1 for m in consumer.consume(100, 0.5) if m.error() is None)
        consumer.commit(asynchronous=False)
        committed = {tp.partition: tp.offset for tp in consumer.committed([TopicPartition(topic, p) for p in (0, 1)])}
    else:
        import kafka

        consumer = kafka.KafkaConsumer(
            topic,
            bootstrap_servers=kcfg.resolved_bootstrap(),
            group_id=group,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        while seen < 40 and time.monotonic() - started < 30:
            seen += sum(len(v) for v in consumer.poll(500).values())
        consumer.commit()
        committed = {p: consumer.committed(kafka.TopicPartition(topic, p)) for p in (0, 1)}
    consumer.close()
    assert seen == 40 and committed == {0: 20, 1: 20}


def test_kafka_python_pinned_to_a_removed_protocol_version_is_refused(
    apache_kafka: ApacheKafkaBroker, kcfg: KafkaConfig, topic: str
) -> None:
    """KIP-896 (Kafka 4.0) removed Produce v0-v2 (message format v0/v1), Fetch v0-v3 and ListOffsets v0: a kafka-python
    producer pinned to ``api_version=(0, 10, 2)`` or older has its connection closed. kbit never pins api_version (the
    client negotiates through ApiVersions and works), so this only documents the broker's exact answer."""
    import kafka
    import kafka.errors

    admin.create_topic(kcfg, topic, 1)
    producer = kafka.KafkaProducer(
        bootstrap_servers=kcfg.resolved_bootstrap(),
        api_version=(0, 10, 2),
        retries=0,
        request_timeout_ms=5000,
        max_block_ms=5000,
    )
    try:
        with pytest.raises(kafka.errors.KafkaConnectionError):
            producer.send(topic, b"old", partition=0).get(10)
    finally:
        producer.close(timeout=2)
    deadline = time.monotonic() + 10
    needle = "UnsupportedVersionException: Received request for api with key 0 (Produce) and unsupported version 2"
    while needle not in apache_kafka.server_log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the broker did not log {needle!r}"
        time.sleep(0.2)
    assert listed_latest(kcfg, topic, 1) == {0: 0}


@pytest.fixture
def apache_config(
    make_config: Callable[..., KbitConfig], apache_kafka: ApacheKafkaBroker
) -> Iterator[Callable[..., KbitConfig]]:
    """``make_config`` pointed at the Apache Kafka broker as an external cluster; its topics deleted afterwards."""
    made: list[KbitConfig] = []

    def _make(**dotted: Any) -> KbitConfig:
        cfg = make_config({"kafka": {"bootstrap_servers": apache_kafka.bootstrap}}, **dotted)
        made.append(cfg)
        return cfg

    yield _make
    for cfg in made:
        for name in admin.list_topics(cfg.kafka):
            admin.delete_topic(cfg.kafka, name)


@pytest.mark.parametrize(
    ("producer_client", "variant"),
    [
        ("confluent", DataVariant(format="raw", layout="bytes", compression="zstd")),
        ("kafka-python", DataVariant(format="json", layout="list", compression="gzip", records_per_message=4)),
    ],
    ids=["confluent-raw-zstd", "kafka-python-json-gzip"],
)
def test_kbit_produce_dataset_and_range_reader(
    apache_config: Callable[..., KbitConfig], producer_client: str, variant: DataVariant
) -> None:
    cfg = apache_config(dataset__num_records=203, produce__partitions=3)
    manifest = produce_dataset(cfg, variant, progress=False, client=producer_client)
    assert manifest.num_records == 203 and manifest.dropped_records == 0
    check = contents.check_topic(cfg.kafka, manifest)
    assert check.holds_manifest, check.problems
    stops = {p: r[1] for p, r in manifest.ranges().items()}
    assert listed_latest(cfg.kafka, manifest.topic, 3) == stops
    assert produce_dataset(cfg, variant, progress=False, client=producer_client) == manifest  # reused as is
    codec = get_codec(variant.format, variant.layout, manifest.dataset.image_shape, variant.records_per_message)
    ranges = [OffsetRange(p, start, stop) for p, (start, stop) in manifest.ranges().items()]
    ranges += [OffsetRange(0, 3, 9), OffsetRange(2, 1, 2)]
    for reader_client in CLIENTS:
        with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, reader_client) as reader:  # type: ignore[arg-type]
            got = list(reader.read_raw(ranges))
        assert [r for r, _ in got] == ranges, reader_client
        for rng, records in got:
            assert [(x.partition, x.offset) for x in records] == [(rng.partition, o) for o in rng.offsets()]
        decoded = [reader.decode(records) for _, records in got[:3]]
        assert sum(len(d.indices) for d in decoded) == 203, reader_client


def test_config_selects_apache_kafka_as_the_embedded_broker(tmp_path, make_config: Callable[..., KbitConfig]) -> None:
    """``kafka.embedded.broker: apache-kafka`` runs Apache Kafka wherever kbit starts its local broker."""
    from kbit_core.brokers.local import embedded_broker, local_broker
    from kbit_core.tracking.environment import broker_identity
    from tests.conftest import free_port

    port, controller_port = free_port(), free_port()
    cfg = make_config(
        {"kafka": {"embedded": {"broker": "apache-kafka", "port": port, "controller_port": controller_port}}},
        dataset__num_records=30,
        produce__partitions=2,
    )
    assert cfg.kafka.uses_embedded and cfg.kafka.resolved_bootstrap() == f"127.0.0.1:{port}"
    broker = local_broker(cfg.run_dir, cfg.kafka.embedded)
    assert isinstance(broker, ApacheKafkaBroker) and broker.controller_port == controller_port
    assert broker_identity(cfg) == {"kind": "embedded", "version": f"apache-kafka {kafka_version()}"}
    with embedded_broker(cfg):
        assert broker.status().running
        manifest = produce_dataset(cfg, DataVariant(format="raw", layout="bytes", compression="snappy"), progress=False)
        assert contents.check_topic(cfg.kafka, manifest).holds_manifest
    assert not broker.status().running
    assert (broker.data_dir / "meta.properties").is_file()  # the data stays on disk under the run dir
    broker.wipe()
    assert not broker.data_dir.exists() and not broker.cluster_id_path.exists()


def test_a_broker_that_cannot_start_names_the_reason(apache_kafka: ApacheKafkaBroker, tmp_path) -> None:
    from kbit_core.errors import BrokerError
    from tests.conftest import free_port

    class Misconfigured(ApacheKafkaBroker):
        def properties(self) -> dict[str, str]:
            return {**super().properties(), "num.io.threads": "many"}

    broker = Misconfigured(tmp_path, port=free_port(), controller_port=free_port())
    with pytest.raises(
        BrokerError, match="(?s)did not start: .*ConfigException: Invalid value many for configuration num.io.threads"
    ) as failed:
        broker.start(timeout_s=60)  # caught by the log directory's format, before the broker's own start
    assert "\tat " not in str(failed.value)  # no Java stack frames
    assert not broker.status().running and not broker.pid_path.exists()
    # the client port of a running broker is refused, naming the setting
    taken = ApacheKafkaBroker(tmp_path / "other", port=apache_kafka.port, controller_port=free_port())
    with pytest.raises(BrokerError, match="already taken.*kafka.embedded.port"):
        taken.start()


@pytest.mark.parametrize("client", CLIENTS)
def test_a_probe_past_the_log_end_leaves_no_error_behind(kcfg: KafkaConfig, topic: str, client: str) -> None:
    """Apache Kafka answers a bounds probe past the log end as out of range (Tansu answers it with the bounds). On a
    consumer that probed before, the probe is answered at once from the cached watermarks, and librdkafka delivers
    the broker's out-of-range answer later, after the probe was unassigned: reads must not take it for their own
    (without the check in ConfluentConsumer.poll: 16-18 of 20 such sequences raised OffsetRangeError)."""
    admin.create_topic(kcfg, topic, 2)
    delivered = produce(kcfg, topic, 2, 600)
    for _ in range(5):
        with make_consumer(kcfg, ReaderConfig(), client) as consumer:  # type: ignore[arg-type]
            assert consumer.offset_bounds(topic, {0: 300, 1: 120}) == {0: (0, 300), 1: (0, 300)}
            assert consumer.offset_bounds(topic, {1: 350}) == {1: (0, 300)}
            assert consumer.poll(10, 0.1) == []
            consumer.assign(topic, {1: 290})
            got: list[RawRecord] = []
            deadline = time.monotonic() + 10
            while len(got) < 10 and time.monotonic() < deadline:
                got += consumer.poll(100, 0.2)
        assert got == expected_records(delivered, {0: (0, 0), 1: (290, 300)})
        # a read that really starts past the log end is still an error
        with make_consumer(kcfg, ReaderConfig(), client) as consumer:  # type: ignore[arg-type]
            consumer.assign(topic, {1: 320})
            with pytest.raises(OffsetRangeError, match="out of range"):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    consumer.poll(100, 0.2)

"""Both consumer backends against the real embedded broker: explicit offsets, re-seeks, errors as kbit errors."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Producer

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError, TopicError
from kbit_core.kafka import admin, offsets, tansu
from kbit_core.kafka.consumers import ConfluentConsumer, KafkaPythonConsumer, RawRecord, make_consumer
from kbit_core.kafka.producers import make_producer
from tests.conftest import embedded_settings

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]

CLIENTS = ["confluent", "kafka-python"]
PER_PARTITION = 300


def produce_values(bootstrap: str, topic: str, partitions: int, per_partition: int, compression: str = "lz4") -> None:
    """Message i of partition p holds b'p:i', sent in multi-record batches."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": compression})
    for i in range(per_partition):
        for p in range(partitions):
            producer.produce(topic, value=f"{p}:{i}".encode(), partition=p)
    assert producer.flush(30) == 0


@pytest.fixture(scope="module")
def topic(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    kcfg = KbitConfig.from_dict({"kafka": {"embedded": embedded_settings(broker)}}).kafka
    name = f"test-consumers-{time.monotonic_ns() % 10**8}"
    admin.create_topic(kcfg, name, 2)
    produce_values(broker.bootstrap, name, 2, PER_PARTITION)
    yield name
    admin.delete_topic(kcfg, name)


def poll_until(consumer, count: int, timeout_s: float = 20.0) -> list[RawRecord]:
    out: list[RawRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < deadline:
        out += consumer.poll(count - len(out), 0.2)
    return out


@pytest.mark.parametrize("client", CLIENTS)
def test_assign_reads_from_explicit_offsets_in_order(make_config: Callable[..., KbitConfig], topic: str, client: str):
    cfg = make_config()
    with make_consumer(cfg.kafka, cfg.reader, client) as consumer:
        assert consumer.client == client
        consumer.assign(topic, {1: 250})
        records = poll_until(consumer, PER_PARTITION - 250)
        assert [(r.partition, r.offset) for r in records] == [(1, o) for o in range(250, PER_PARTITION)]
        assert [r.value for r in records] == [f"1:{o}".encode() for o in range(250, PER_PARTITION)]
        assert consumer.poll(10, 0.3) == [], "nothing exists past the end"


@pytest.mark.parametrize("client", CLIENTS)
def test_reassign_moves_backwards_and_across_partitions(
    make_config: Callable[..., KbitConfig], topic: str, client: str
):
    cfg = make_config()
    with make_consumer(cfg.kafka, cfg.reader, client) as consumer:
        consumer.assign(topic, {0: 100})
        first = poll_until(consumer, 5)
        consumer.assign(topic, {0: 7})
        again = poll_until(consumer, 3)
        consumer.assign(topic, {1: 0})
        other = poll_until(consumer, 2)
    assert [r.offset for r in first[:5]] == list(range(100, 105))
    assert [(r.partition, r.offset) for r in again[:3]] == [(0, 7), (0, 8), (0, 9)]
    assert [(r.partition, r.value) for r in other[:2]] == [(1, b"1:0"), (1, b"1:1")]


@pytest.mark.parametrize("client", CLIENTS)
def test_poll_respects_max_records(make_config: Callable[..., KbitConfig], topic: str, client: str):
    cfg = make_config()
    with make_consumer(cfg.kafka, cfg.reader, client) as consumer:
        consumer.assign(topic, {0: 0})
        sizes = []
        deadline = time.monotonic() + 20
        while sum(sizes) < PER_PARTITION and time.monotonic() < deadline:
            sizes.append(len(consumer.poll(7, 0.2)))
    assert sum(sizes) == PER_PARTITION and max(sizes) <= 7


@pytest.mark.parametrize("client", CLIENTS)
def test_offset_bounds_come_from_list_offsets_on_apache_kafka_and_from_one_probe_fetch_on_tansu(
    make_config: Callable[..., KbitConfig], topic: str, client: str, monkeypatch: pytest.MonkeyPatch
):
    # The topic was sent in multi-record batches, which Tansu's ListOffsets(LATEST) answers short: there the exact
    # ends come from the probe's Fetch response alone. Apache Kafka's ListOffsets is exact, and no fetch is made.
    listed: list[list[int]] = []
    probed: list[dict[int, int]] = []
    list_offsets, fetch_bounds = admin.list_offsets, tansu.fetch_bounds
    monkeypatch.setattr(
        admin, "list_offsets", lambda c, k, t, parts: listed.append(list(parts)) or list_offsets(c, k, t, parts)
    )
    monkeypatch.setattr(
        tansu,
        "fetch_bounds",
        lambda c, k, t, probes, *rest: probed.append(dict(probes)) or fetch_bounds(c, k, t, probes, *rest),
    )
    cfg = make_config()
    with make_consumer(cfg.kafka, cfg.reader, client) as consumer:
        assert consumer.bounds_opens_client is (client == "kafka-python")
        # at the log end the response holds no record, only the bounds
        assert consumer.offset_bounds(topic, {0: PER_PARTITION, 1: 120}) == {
            0: (0, PER_PARTITION),
            1: (0, PER_PARTITION),
        }
        # a probe past the log end (a stale plan) still comes back with the true bounds, so the check can name them
        assert consumer.offset_bounds(topic, {1: PER_PARTITION + 50}) == {1: (0, PER_PARTITION)}
        if cfg.kafka.tansu:
            assert listed == [] and probed == [{0: PER_PARTITION, 1: 120}, {1: PER_PARTITION + 50}]
        else:
            assert listed == [[0, 1], [1]] and probed == []
        # the check left no assignment behind: reading goes on from wherever the caller assigns
        assert consumer.poll(10, 0.1) == []
        consumer.assign(topic, {1: PER_PARTITION - 10})
        assert [r.offset for r in poll_until(consumer, 10)] == list(range(PER_PARTITION - 10, PER_PARTITION))


def test_a_probe_fetch_answered_out_of_range_lists_offsets_and_probes_below_the_end(
    make_config: Callable[..., KbitConfig], topic: str
):
    # Apache Kafka answers a probe outside the log as out of range (Tansu answers it with the bounds regardless):
    # the partition is asked with ListOffsets, then probed again below its approximate (on Tansu: short) end.
    kcfg = make_config().kafka
    consumer = offsets._offset_consumer(kcfg)
    try:
        bounds = tansu.fetch_bounds(consumer, kcfg, topic, {0: 5, 1: PER_PARTITION + 50})
    finally:
        consumer.close()
    assert bounds == {0: (0, PER_PARTITION), 1: (0, PER_PARTITION)}


@pytest.mark.parametrize("client", CLIENTS)
def test_offset_bounds_name_a_missing_topic_or_partition(
    make_config: Callable[..., KbitConfig], topic: str, client: str
):
    cfg = make_config()
    with make_consumer(cfg.kafka, cfg.reader, client) as consumer:
        with pytest.raises(TopicError, match=rf"topic '{topic}' has no partition\(s\) \[5\] \(it has \[0, 1\]\)"):
            consumer.offset_bounds(topic, {0: 0, 5: 0})
        with pytest.raises(TopicError, match=f"topic '{topic}-missing' does not exist on the embedded broker"):
            consumer.offset_bounds(f"{topic}-missing", {0: 0})


def test_make_consumer_picks_the_configured_client(make_config: Callable[..., KbitConfig]):
    cfg = make_config(kafka__client="kafka-python")
    with make_consumer(cfg.kafka, cfg.reader) as default, make_consumer(cfg.kafka, cfg.reader, "confluent") as c:
        assert isinstance(default, KafkaPythonConsumer) and isinstance(c, ConfluentConsumer)
    with pytest.raises(ConfigError, match="unknown Kafka client 'librdkafka'"):
        make_consumer(cfg.kafka, cfg.reader, "librdkafka")  # type: ignore[arg-type]


def test_kafka_python_clients_bootstrap_past_a_server_that_drops_connections(
    make_config: Callable[..., KbitConfig], topic: str, broker: EmbeddedBroker, silent_server: str
):
    """kafka-python bootstraps from one server it picks at random and spent its whole 30 s bootstrap deadline on a
    server that drops connections (a cut-off broker on the test bed); kbit hands it those that accept. Three
    consumers and three producers: each used to pick the silent server with even odds."""
    cfg = make_config(kafka__bootstrap_servers=f"{silent_server},{broker.bootstrap}")
    for _ in range(3):
        with make_consumer(cfg.kafka, cfg.reader, "kafka-python") as consumer:
            consumer.assign(topic, {0: 0})
            assert [r.value for r in poll_until(consumer, 2)[:2]] == [b"0:0", b"0:1"]
        make_producer(cfg.kafka, cfg.produce, "none", "kafka-python").close()  # its constructor bootstraps

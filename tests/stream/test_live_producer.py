"""The live producer against a real embedded broker: rate-paced appends, an exact manifest, broker restarts, and
either producer client meeting a broker crash with sends in flight."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig
from kbit_core.errors import BrokerError, ManifestMismatchError, TopicError
from kbit_core.kafka import admin, offsets
from kbit_core.kafka.manifest import PartitionManifest
from kbit_core.kafka.producers import BACKENDS, DeliveryLedger, make_producer
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.stream_log import StreamLog
from tests.conftest import Background, embedded_settings
from tests.stream.stream_fixtures import crash_and_restart, freeze, stream_config, wait_until_in_flight

pytestmark = pytest.mark.kafka


def read_all(cfg: KbitConfig, topic: str) -> list[tuple[int, int, int, int]]:
    """(partition, offset, key as index, timestamp ms) of every record on the broker."""
    ends = offsets.exact_end_offsets(cfg.kafka, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": cfg.kafka.resolved_bootstrap(),
            "group.id": "test-stream-read",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    out: list[tuple[int, int, int, int]] = []
    deadline = time.monotonic() + 20
    while len(out) < sum(ends.values()) and time.monotonic() < deadline:
        for msg in consumer.consume(500, 0.5):
            assert msg.error() is None, msg.error()
            out.append((msg.partition(), msg.offset(), int(msg.key()), msg.timestamp()[1]))
    consumer.close()
    return sorted(out)


@pytest.mark.both_brokers
def test_appends_at_the_rate_and_the_manifest_matches_the_broker(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    before_ms = int(time.time() * 1000)
    run = LiveProducer(cfg).run(rate=400, records=120)
    assert (run.produced, run.next_index, run.refilled) == (120, 120, 0)
    assert run.seconds >= 120 / 400 * 0.8  # paced, not sent in one burst
    records = read_all(cfg, run.topic)
    # index i at partition i % 3, in offset order: the manifest's runs say the same
    assert [(p, index) for p, _, index, _ in records] == sorted((i % 3, i) for i in range(120))
    assert all(ts >= before_ms for *_, ts in records)  # the message timestamp is the produce time
    log = StreamLog.load(Path(run.manifest_path))
    assert log.runs() == {p: [[p, 117 + p]] for p in range(3)}
    assert log.end_offsets() == {0: 40, 1: 40, 2: 40}


@pytest.mark.both_brokers
def test_a_restarted_producer_continues_the_sequence(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=31)
    run = LiveProducer(cfg).run(rate=5000, records=61)
    assert (run.produced, run.next_index, run.refilled) == (30, 61, 0)
    assert [index for _, _, index, _ in read_all(cfg, run.topic)] == sorted(range(61), key=lambda i: (i % 3, i))


def test_a_broker_that_lost_the_topic_gets_it_back_at_the_same_offsets(
    tmp_path: Path, own_broker: EmbeddedBroker
) -> None:
    cfg = stream_config(tmp_path, own_broker)
    first = LiveProducer(cfg).run(rate=5000, records=45)
    before = read_all(cfg, first.topic)
    own_broker.stop()
    own_broker.start()
    assert not admin.topic_exists(cfg.kafka, first.topic)
    run = LiveProducer(cfg).run(rate=5000, records=60)
    assert (run.refilled, run.produced, run.next_index) == (45, 15, 60)
    after = read_all(cfg, run.topic)
    assert [r[:3] for r in after if r[2] < 45] == [r[:3] for r in before]


def topic_id(cfg: KbitConfig, topic: str) -> str:
    client = AdminClient({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    return str(client.describe_topics(TopicCollection([topic]))[topic].result(10).topic_id)


def test_an_empty_topic_is_refilled_in_place_not_recreated(tmp_path: Path, own_broker: EmbeddedBroker) -> None:
    """Recreating a topic crashes the readers assigned to it (librdkafka 2.16: SIGSEGV, every trainer rank at
    once), and an empty one with the stream's partitions holds nothing misplaced."""
    cfg = stream_config(tmp_path, own_broker)
    first = LiveProducer(cfg).run(rate=5000, records=45)
    crash_and_restart(own_broker)
    admin.create_topic(cfg.kafka, first.topic, 3)  # by whoever came first after the restart
    created = topic_id(cfg, first.topic)
    run = LiveProducer(cfg).run(rate=5000, records=60)
    assert (run.refilled, run.produced, run.next_index) == (45, 15, 60)
    assert topic_id(cfg, first.topic) == created
    assert [index for _, _, index, _ in read_all(cfg, run.topic)] == sorted(range(60), key=lambda i: (i % 3, i))


def test_a_running_producer_survives_a_broker_restart(tmp_path: Path, own_broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, own_broker)
    producer = LiveProducer(cfg)
    stop = threading.Event()
    running = Background(producer.run, rate=100, records=600, should_stop=stop.is_set)
    deadline = time.monotonic() + 30
    while producer.log.next_index() < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    # With records in flight at the crash, the restarted broker answers their retry UNKNOWN_PRODUCER_ID, which
    # is fatal to an idempotent producer: it must be replaced, and the records must not be lost.
    freeze(own_broker)
    wait_until_in_flight(own_broker)
    crash_and_restart(own_broker)
    try:
        run = running.result(120)
    finally:
        stop.set()
    assert run.reconnects >= 1 and run.refilled > 0
    assert [index for _, _, index, _ in read_all(cfg, run.topic)] == sorted(range(600), key=lambda i: (i % 3, i))


@pytest.mark.parametrize("client", sorted(BACKENDS))
def test_sends_in_flight_at_a_broker_crash_fail_with_a_broker_error(
    tmp_path: Path, own_broker: EmbeddedBroker, client: str
) -> None:
    cfg = stream_config(tmp_path, own_broker)
    admin.create_topic(cfg.kafka, "in-flight", 1)
    backend = make_producer(cfg.kafka, cfg.produce, "none", client)

    def deliver(count: int) -> list[PartitionManifest]:
        ledger = DeliveryLedger("in-flight", 1)
        for _ in range(count):
            backend.send("in-flight", 0, b"key", b"value", ledger.callback(1, 5))
        backend.flush(10, count_wire_bytes=False)
        return ledger.partitions()

    assert [p.num_messages for p in deliver(5)] == [5]
    freeze(own_broker)
    sending = Background(deliver, 5)
    wait_until_in_flight(own_broker)
    crash_and_restart(own_broker)
    # confluent-kafka raises this fatal error inside flush and then calls the next delivery callback with it still
    # raised: before kbit queued the reports, the ledger's lock was left locked and flush hung. kafka-python keeps
    # retrying until flush's deadline (then kbit's error says what the broker last answered), or fails the batch with
    # UNKNOWN_PRODUCER_ID as well. Never a hang.
    expected = {
        "confluent": r"(?i)unknown ?producer ?id",
        "kafka-python": r"UnknownProducerId|still undelivered after \d+s; the last answer: .*KafkaConnectionError",
    }[client]
    with pytest.raises(BrokerError, match=expected):
        sending.result(60)
    backend.close()


@pytest.mark.both_brokers
def test_another_stream_config_does_not_continue_the_manifest(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=3)
    changed = cfg.override({"produce.variant.format": "json"})
    with pytest.raises(ManifestMismatchError, match="variant"):
        LiveProducer(changed)


@pytest.mark.both_brokers
def test_records_the_manifest_does_not_know_are_refused(tmp_path: Path, broker: EmbeddedBroker) -> None:
    from confluent_kafka import Producer

    cfg = stream_config(tmp_path, broker)
    run = LiveProducer(cfg).run(rate=5000, records=6)
    stranger = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    stranger.produce(run.topic, value=b"x", key=b"99", partition=1)
    stranger.flush(10)
    with pytest.raises(TopicError, match="another producer"):
        LiveProducer(cfg).run(rate=5000, records=9)


@pytest.mark.both_brokers
def test_the_cli_flag_runs_the_live_producer(tmp_path: Path, broker: EmbeddedBroker) -> None:
    from typer.testing import CliRunner

    from kbit_core.cli import app

    cfg = stream_config(tmp_path, broker)
    args = [
        "produce",
        "--stream",
        "--rate",
        "500",
        "--records",
        "25",
        "--topic",
        cfg.stream.topic,
        "--json",
        "--set",
        f"workdir={cfg.workdir}",
        *(f"--set=kafka.embedded.{k}={v}" for k, v in embedded_settings(broker).items()),
        "--set",
        "produce.variant.format=raw",
        "--set",
        "produce.variant.layout=bytes",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["topic"], summary["produced"], summary["next_index"]) == (cfg.stream.topic, 25, 25)
    assert summary["target_rate"] == 500 and summary["achieved_rate"] > 0
    assert len(read_all(cfg, cfg.stream.topic)) == 25

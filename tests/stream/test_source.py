"""StreamSource on the real broker: index-order merging, start positions, gap detection, lag from watermarks."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.formats import get_codec
from kbit_core.kafka import admin
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.source import StreamGapError, StreamSource
from tests.stream.stream_fixtures import crash_and_restart, stream_config

pytestmark = pytest.mark.kafka


def make_source(cfg: KbitConfig, partitions: tuple[int, ...]) -> StreamSource:
    source = open_source(cfg.dataset)
    codec = get_codec("raw", "bytes", source.image_shape, 1, num_classes=source.num_classes)
    return StreamSource(cfg, codec, cfg.stream.topic_for(cfg.dataset, cfg.produce), partitions, cfg.produce.partitions)


@pytest.mark.both_brokers
def test_records_come_in_stream_index_order_and_positions_follow(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=30)
    source = make_source(cfg, (0, 2))  # rank 0 of 2 over 3 partitions
    source.start_fresh()
    assert source.fill(8, timeout_s=10) == 8
    batch = source.take(8)
    assert batch.x.shape == (8, 1, 28, 28) and batch.y.shape == (8,)
    assert {p: (pos.offset, pos.index, pos.trained) for p, pos in source.positions.items()} == {
        0: (4, 12, [[0, 9]]),
        2: (4, 14, [[2, 11]]),
    }  # indices 0 2 3 5 6 8 9 11: merged in index order
    assert source.lag(int(time.time() * 1000))[0][0] == 10 - 4  # 10 records in partition 0, 4 trained
    source.close()


@pytest.mark.both_brokers
def test_a_checkpoint_position_continues_exactly_there(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=30)
    source = make_source(cfg, (1,))
    source.load_positions([0, 3, 0], [None, 10, None], [[], [[1, 7]], []])
    source.fill(2, timeout_s=10)
    source.take(2)
    assert (source.positions[1].offset, source.positions[1].trained) == (5, [[1, 13]])
    source.close()


@pytest.mark.both_brokers
def test_a_timestamp_start_skips_what_was_produced_before(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=30)
    time.sleep(0.05)
    start_ms = int(time.time() * 1000)
    LiveProducer(cfg).run(rate=5000, records=60)
    source = make_source(cfg.override({"stream.start": "timestamp", "stream.start_timestamp_ms": start_ms}), (0, 1, 2))
    source.start_fresh()
    assert source.fill(30, timeout_s=10) == 30
    source.take(30)
    assert {p: pos.trained for p, pos in source.positions.items()} == {p: [[30 + p, 57 + p]] for p in range(3)}
    source.close()


@pytest.mark.both_brokers
def test_a_record_out_of_sequence_is_an_error_naming_where(tmp_path: Path, broker: EmbeddedBroker) -> None:
    cfg = stream_config(tmp_path, broker)
    LiveProducer(cfg).run(rate=5000, records=6)
    stranger = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    stranger.produce(cfg.stream.topic, value=b"x", key=b"3", partition=0)  # index 3 is partition 0's already
    stranger.flush(10)
    source = make_source(cfg, (0,))
    source.start_fresh()
    source.fill(3, timeout_s=10)
    with pytest.raises(
        StreamGapError,
        match=rf"{cfg.stream.topic}\[0\] at offset 2 holds index 3; the next to "
        r"train is offset 2, index 6",
    ):
        source.take(3)
    source.close()


def read_across_a_lost_and_recreated_topic(cfg: KbitConfig, broker: EmbeddedBroker, out: Path) -> None:
    """Read the stream's 40 records; lose them with the broker; while the reader waits, the topic is created empty
    and recreated three times (as producers refilling it may); once the live producer has refilled it and appended
    20, read on. Each partition's trained index runs, as JSON in ``out``."""
    LiveProducer(cfg).run(rate=5000, records=40)
    source = make_source(cfg, (0, 1))
    source.start_fresh()
    assert source.fill(40, timeout_s=10) == 40
    source.take(40)
    crash_and_restart(broker)
    deadline = time.monotonic() + 30
    while source.resets == 0 and time.monotonic() < deadline:
        source.fill(1, timeout_s=0.5)
    assert source.resets == 1
    admin.create_topic(cfg.kafka, cfg.stream.topic, 2)
    for _ in range(3):
        source.fill(1, timeout_s=1.5)
        admin.delete_topic(cfg.kafka, cfg.stream.topic)
        admin.create_topic(cfg.kafka, cfg.stream.topic, 2)
    LiveProducer(cfg).run(rate=5000, records=60)
    assert source.fill(20, timeout_s=20) == 20
    source.take(20)
    source.close()
    out.write_text(json.dumps({p: pos.trained for p, pos in source.positions.items()}))


def test_a_reader_whose_topic_was_lost_reads_on_once_refilled_and_survives_its_recreation(
    tmp_path: Path, own_broker: EmbeddedBroker
) -> None:
    """librdkafka 2.16 crashes the process (SIGSEGV) when a topic is deleted and created again under a consumer
    assigned to it: the reader holds none until the log reaches its offsets again. In a process of its own, so
    that a crash fails this test alone."""
    cfg = stream_config(tmp_path, own_broker, {"produce": {"partitions": 2}})
    out = tmp_path / "trained.json"
    reader = multiprocessing.get_context("spawn").Process(
        target=read_across_a_lost_and_recreated_topic, args=(cfg, own_broker, out)
    )
    reader.start()
    reader.join(180)
    if reader.is_alive():
        reader.kill()
        pytest.fail("the reader did not finish within 180 s")
    assert reader.exitcode == 0, f"the reader's process ended with {reader.exitcode} (negative: killed by that signal)"
    assert json.loads(out.read_text()) == {"0": [[0, 58]], "1": [[1, 59]]}

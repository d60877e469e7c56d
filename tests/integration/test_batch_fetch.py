"""``reader.fetch: batches`` against the real brokers: every format, layout, compression and grouping decodes to what
the client's consumer delivers; records deleted under a checked range and a broker that does not answer are
one-line errors naming where (records deleted under a checked range: test_log_semantics.py, on Apache Kafka)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kbit_core.config import KafkaConfig, KbitConfig, ReaderConfig
from kbit_core.data.reader import RangeReader
from kbit_core.errors import BrokerError, ReadTimeoutError
from kbit_core.kafka.batch_consumer import BatchConsumer
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.sharding import OffsetRange
from tests.conftest import free_port
from tests.integration.dataplane_fixtures import Produce

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]

VARIANTS = {
    "raw-lz4": {"format": "raw", "layout": "bytes", "compression": "lz4"},
    "raw-x4-none": {"format": "raw", "layout": "bytes", "compression": "none", "records_per_message": 4},
    "protobuf-zstd": {"format": "protobuf", "layout": "bytes", "compression": "zstd"},
    "json-list-gzip": {"format": "json", "layout": "list", "compression": "gzip"},
    "avro-snappy": {"format": "avro", "layout": "bytes", "compression": "snappy"},
}


def decoded(cfg: KbitConfig, manifest: Any, ranges: list[OffsetRange], fetch: str) -> list[tuple]:
    fetch_cfg = cfg.override({"reader.fetch": fetch})
    codec = manifest_codec(manifest, fetch_cfg.reader.decoder, fetch_cfg.registry)
    with RangeReader(fetch_cfg.kafka, fetch_cfg.reader, manifest.topic, codec) as reader:
        out = [
            (r, b.indices.tolist(), b.labels.tolist(), np.asarray(b.pixels).tobytes()) for r, b in reader.read(ranges)
        ]
    assert reader.stats.gaps == 0 and reader.stats.skipped == 0
    return out


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_fetched_batches_decode_to_what_the_consumer_delivers(produce_topic: Produce, variant):
    cfg, manifest = produce_topic(variant, 160, partitions=2, reader__max_poll_records=50)
    whole = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    # parts that start inside a compressed batch, jump backwards, and continue where the last one stopped
    parts = [OffsetRange(0, 7, 19), OffsetRange(1, 3, 4), OffsetRange(0, 2, 7), OffsetRange(0, 19, whole[0].stop)]
    expected = decoded(cfg, manifest, whole + parts, "messages")
    assert decoded(cfg, manifest, whole + parts, "batches") == expected
    assert sum(len(indices) for _, indices, _, _ in expected[:2]) == 160


def test_a_bootstrap_server_that_refuses_is_named_by_the_poll_not_by_a_fetch_sent_ahead():
    consumer = BatchConsumer(KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}"), ReaderConfig())
    consumer.assign("any-topic", {0: 0})
    consumer.fetch_ahead(0, 0, 10)  # only a head start, outside the reader's retries: it raises nothing
    with pytest.raises(BrokerError, match=r"no bootstrap server answered a Metadata request: cannot connect to broker"):
        consumer.poll(10, 0.1)


def test_a_reader_whose_leader_stops_answering_names_the_range_after_its_deadline(
    produce_topic: Produce, monkeypatch: pytest.MonkeyPatch
):
    cfg, manifest = produce_topic(VARIANTS["raw-lz4"], 40, partitions=1, reader__fetch="batches", reader__deadline_s=2)
    codec = manifest_codec(manifest, cfg.reader.decoder, cfg.registry)
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        reader.check([OffsetRange(0, 0, 40)])
        port = free_port()  # nothing listens there: every connection to "the leader" is refused

        def leader_that_refuses(self: BatchConsumer) -> None:
            self._brokers, self._leaders = {99: ("127.0.0.1", port)}, {0: 99}

        monkeypatch.setattr(BatchConsumer, "_ask_metadata", leader_that_refuses)
        with pytest.raises(ReadTimeoutError, match=r"no progress for 2s reading planned range \[0, 40\)") as raised:
            list(reader.read_raw([OffsetRange(0, 0, 40)]))
    assert "with kbit's own Fetch requests (reader.fetch: batches)" in str(raised.value)
    assert "cannot connect to broker 127.0.0.1" in str(raised.value)


def test_a_fetch_sent_ahead_for_a_range_never_read_is_dropped_not_delivered(produce_topic: Produce):
    cfg, manifest = produce_topic(VARIANTS["raw-lz4"], 60, partitions=2, reader__fetch="batches")
    codec = manifest_codec(manifest, cfg.reader.decoder, cfg.registry)
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        reads = reader.read_raw([OffsetRange(0, 0, 10), OffsetRange(1, 5, 15)])
        _, records = next(reads)  # partition 1's Fetch is sent before this range is handed over
        assert [r.offset for r in records] == list(range(10))
        reads.close()  # ... and is never read by this call
        ((_, records),) = list(reader.read_raw([OffsetRange(0, 20, 30)]))
        assert [(r.partition, r.offset) for r in records] == [(0, o) for o in range(20, 30)]
        ((_, records),) = list(reader.read_raw([OffsetRange(1, 5, 15)]))
        assert [(r.partition, r.offset) for r in records] == [(1, o) for o in range(5, 15)]


def test_the_next_ranges_fetch_is_sent_before_this_ranges_answer_is_read(
    produce_topic: Produce, monkeypatch: pytest.MonkeyPatch
):
    cfg, manifest = produce_topic(VARIANTS["raw-lz4"], 60, partitions=2, reader__fetch="batches")
    codec = manifest_codec(manifest, cfg.reader.decoder, cfg.registry)
    events: list[tuple[str, int, int]] = []
    send, receive = BatchConsumer._send, BatchConsumer._receive

    def logged_send(self: BatchConsumer, partition: int, offset: int, *args: Any) -> tuple[int, int, int, int]:
        events.append(("send", partition, offset))
        return send(self, partition, offset, *args)

    def logged_receive(self: BatchConsumer, sent: tuple[int, int, int, int]) -> Any:
        events.append(("receive", *sent[:2]))
        return receive(self, sent)

    monkeypatch.setattr(BatchConsumer, "_send", logged_send)
    monkeypatch.setattr(BatchConsumer, "_receive", logged_receive)
    ranges = [OffsetRange(0, 0, 10), OffsetRange(1, 5, 15), OffsetRange(0, 15, 22), OffsetRange(0, 22, 27)]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        read = [(r, [rec.offset for rec in records]) for r, records in reader.read_raw(ranges)]
    assert read == [(r, list(range(r.start, r.stop))) for r in ranges]
    # the first range's Fetch goes out as it is read (the consumer has no assignment before); then each range's
    # Fetch and the next range's are in flight before the range's answer is read. The last range continues the one
    # before, whose Fetch asked for both (and the 64 KiB a Fetch asks for at least holds all 30 of the partition's
    # records): no Fetch of its own.
    assert events == [
        ("send", 0, 0),
        ("receive", 0, 0),
        ("send", 1, 5),
        ("send", 0, 15),
        ("receive", 1, 5),
        ("receive", 0, 15),
    ]

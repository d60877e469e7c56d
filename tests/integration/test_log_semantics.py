"""Real log semantics on Apache Kafka: records deleted below a manifest, aborted transactions, compacted topics.

Each case is made with the broker's own means (DeleteRecords, a transactional producer that aborts, a topic
altered to cleanup.policy=compact), never simulated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ManifestMismatchError, OffsetRangeError, TopicError
from kbit_core.formats import get_codec
from kbit_core.jobs import train as train_job
from kbit_core.kafka import admin, offsets
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.kafka.producers import DeliveryLedger
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange
from tests.conftest import SMALL_TRAINING
from tests.integration.dataplane_fixtures import READERS, Produce, reader_settings

pytestmark = pytest.mark.kafka

RAW = {"format": "raw", "layout": "bytes", "compression": "lz4"}


@pytest.fixture(scope="module")
def broker(apache_kafka: Any) -> Any:
    """Every test here runs on Apache Kafka, whatever the suite's broker: Tansu has no DeleteRecords that moves the
    log start, and keeps no transaction state across its batches as Kafka does."""
    return apache_kafka


def admin_client(cfg: KbitConfig) -> AdminClient:
    return AdminClient({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})


def test_records_deleted_below_the_manifest_are_named_before_any_rank_starts(
    make_config: Callable[..., KbitConfig], monkeypatch: pytest.MonkeyPatch
):
    cfg = make_config(SMALL_TRAINING, dataset__num_records=200)
    manifest = produce_dataset(cfg, progress=False)
    # DeleteRecords moves partition 1's log start to offset 30 (what retention does segment by segment)
    client = admin_client(cfg)  # kept: a collected client never completes its futures
    futures = client.delete_records([TopicPartition(manifest.topic, 1, 30)])
    assert [f.result(30).low_watermark for f in futures.values()] == [30]
    launched: list[object] = []
    monkeypatch.setattr(train_job, "train_with_restarts", lambda *args: launched.append(args))

    message = (
        rf"topic '{manifest.topic}' no longer holds its manifest .*{manifest.topic}\.json: partition 1: offsets "
        r"0\.\.29 of the manifest's 0\.\.99 are gone \(the log starts at 30: retention or DeleteRecords removed "
        r"them\); produce it again with --recreate \(produce.recreate\)$"
    )
    with pytest.raises(ManifestMismatchError, match=message) as raised:
        train_job.train(cfg, progress=False)
    assert "\n" not in str(raised.value) and launched == []
    # a reader planned before the deletion names the partition and the first offset it can no longer read
    codec = get_codec("raw", "bytes", manifest.dataset.image_shape)
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        with pytest.raises(
            OffsetRangeError, match=r"planned range \[0, 100\) is outside the stored offsets \[30, 100\)"
        ):
            reader.check([OffsetRange(1, 0, 100)])
    admin.delete_topic(cfg.kafka, manifest.topic)


def transaction(cfg: KbitConfig, producer: Producer, topic: str, values: list[bytes], *, commit: bool) -> list[int]:
    """Send ``values`` to partition 0 in one transaction, committed or aborted; their offsets. Waits until the
    transaction's marker is in the log (the coordinator writes it after commit/abort returns)."""
    written: list[int] = []
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value, partition=0, on_delivery=lambda err, msg: written.append(msg.offset()))
    producer.flush(30)
    (producer.commit_transaction if commit else producer.abort_transaction)(30)
    deadline = time.monotonic() + 30
    while offsets.exact_end_offsets(cfg.kafka, topic)[0] < written[-1] + 2:
        assert time.monotonic() < deadline, f"the transaction marker did not reach {topic}[0] within 30 s"
        time.sleep(0.05)
    return sorted(written)


def raw_values(codec: Any, indices: range) -> list[bytes]:
    images = np.zeros((len(indices), *codec.image_shape), np.uint8)
    return codec.encode(np.array(indices), images, np.array(indices) % 10)


@pytest.mark.parametrize("reader", READERS)
def test_aborted_transactions_are_never_read_and_their_offsets_are_gaps(
    make_config: Callable[..., KbitConfig], topic_name: str, reader: str
):
    client, fetch = reader_settings(reader)
    cfg = make_config(**fetch)
    codec = get_codec("raw", "bytes", (1, 28, 28))
    admin.create_topic(cfg.kafka, topic_name, 1)
    producer = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap(), "transactional.id": topic_name})
    producer.init_transactions(30)
    ledger = DeliveryLedger(topic_name, 1)  # what a manifest would record of the committed records
    committed: list[int] = []
    for indices, commit in ((range(0, 5), True), (range(100, 105), False), (range(5, 10), True)):
        written = transaction(cfg, producer, topic_name, raw_values(codec, indices), commit=commit)
        if commit:
            committed += written
            for offset in written:
                ledger.callback(1, 1)(0, offset, None)
    log_end = offsets.exact_end_offsets(cfg.kafka, topic_name)[0]
    # 0..4 committed, 5 its marker, 6..10 aborted, 11 the abort marker, 12..16 committed, 17 its marker
    assert committed == [0, 1, 2, 3, 4, 12, 13, 14, 15, 16] and log_end == 18

    with RangeReader(cfg.kafka, cfg.reader, topic_name, codec, client) as reader:
        ((_, batch),) = list(reader.read([OffsetRange(0, 0, log_end)]))
    assert batch.indices.tolist() == list(range(10))
    assert reader.stats.messages == 10 and reader.stats.gaps == 8
    # offsets with aborted records or markers between a producer's records never make a manifest
    with pytest.raises(TopicError, match=r"10 messages landed at offsets 0\.\.16, which are not contiguous"):
        ledger.partitions()
    admin.delete_topic(cfg.kafka, topic_name)


def test_a_compacted_topic_is_refused(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 20, partitions=1)
    assert admin.topic_config(cfg.kafka, manifest.topic)["cleanup.policy"] == "delete"
    compact = ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ResourceType.TOPIC, manifest.topic, incremental_configs=[compact])
    client = admin_client(cfg)  # kept: a collected client never completes its futures
    for future in client.incremental_alter_configs([resource]).values():
        future.result(30)
    with pytest.raises(TopicError, match=rf"topic '{manifest.topic}' has cleanup.policy=compact: compaction removes"):
        produce_dataset(cfg, DataVariant(**RAW), progress=False)


def test_records_deleted_after_the_check_are_an_error_naming_partition_and_offset(produce_topic: Produce):
    """kbit's own Fetch requests (reader.fetch: batches) meet the broker's OFFSET_OUT_OF_RANGE themselves."""
    cfg, manifest = produce_topic(RAW, 100, partitions=1, reader__fetch="batches")
    codec = manifest_codec(manifest, cfg.reader.decoder, cfg.registry)
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        reader.check([OffsetRange(0, 0, 100)])
        client = admin_client(cfg)
        futures = client.delete_records([TopicPartition(manifest.topic, 0, 40)])
        assert [f.result(30).low_watermark for f in futures.values()] == [40]
        with pytest.raises(OffsetRangeError, match="offset out of range") as raised:
            list(reader.read_raw([OffsetRange(0, 0, 100)]))
    message = str(raised.value)
    assert f"topic={manifest.topic}" in message and "partition=0" in message and "\n" not in message

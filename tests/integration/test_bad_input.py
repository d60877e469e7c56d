"""Bad input on the read side: each case ends in a clear kbit error naming what and where, within a deadline."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import CorruptRecordError, ManifestMismatchError, OffsetRangeError, ReadTimeoutError, TopicError
from kbit_core.formats import get_codec
from kbit_core.sharding import OffsetRange
from tests.conftest import free_port
from tests.integration.dataplane_fixtures import RAW, Produce, extended, inject, source_truth

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]


def drain(loader) -> list:
    return [b.indices.tolist() for b in loader.iter_indexed()]


@pytest.mark.parametrize("mode", ["stream", "eager"])
@pytest.mark.parametrize("value", [b"\x00garbage", b""], ids=["garbage", "empty"])
def test_corrupt_value_fails_with_its_coordinates(produce_topic: Produce, mode, value):
    cfg, manifest = produce_topic(
        RAW, 40, partitions=2, reader__mode=mode, shard__split_rates=[0.5, 0.5], train__global_batch_size=4
    )
    offset = inject(cfg, manifest.topic, 1, value)
    with make_split_loader(cfg, extended(manifest, 1, 1), "val", 0, 1) as loader:
        with pytest.raises(CorruptRecordError, match=r"does not decode as raw/bytes") as err:
            drain(loader)
    assert (err.value.topic, err.value.partition, err.value.offset) == (manifest.topic, 1, offset)


def test_truncated_message_fails_with_its_coordinates(produce_topic: Produce):
    cfg, manifest = produce_topic({"format": "avro", "layout": "list", "compression": "lz4"}, 20, partitions=1)
    codec = get_codec("avro", "list", manifest.dataset.image_shape)
    images, labels = source_truth(cfg)
    whole = codec.encode([7], images[7:8], labels[7:8])[0]
    offset = inject(cfg, manifest.topic, 0, whole[: len(whole) // 2])
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        with pytest.raises(CorruptRecordError, match=rf"partition=0, offset={offset}"):
            list(reader.read([OffsetRange(0, 0, offset + 1)]))


@pytest.mark.parametrize("fmt", ["json", "bson"])
@pytest.mark.parametrize("cut", [0.5, 0.999], ids=["half", "last-bytes"])
def test_a_damaged_list_value_fails_with_the_stock_error_and_its_coordinates(produce_topic: Produce, fmt, cut):
    # the fast list decoders hand a value they cannot read to the stock library, whose error the reader names
    cfg, manifest = produce_topic({"format": fmt, "layout": "list", "compression": "none"}, 20, partitions=1)
    stock = get_codec(fmt, "list", manifest.dataset.image_shape)
    images, labels = source_truth(cfg)
    whole = stock.encode([7], images[7:8], labels[7:8])[0]
    damaged = whole[: int(len(whole) * cut)]
    offset = inject(cfg, manifest.topic, 0, damaged)
    with pytest.raises(CorruptRecordError) as expected:
        stock.decode([damaged])
    fast = get_codec(fmt, "list", manifest.dataset.image_shape, decoder="fast")
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, fast) as reader:
        with pytest.raises(CorruptRecordError, match=rf"partition=0, offset={offset}") as err:
            list(reader.read([OffsetRange(0, 0, offset + 1)]))
    assert str(expected.value) in str(err.value) and manifest.topic in str(err.value)


def test_skip_policy_counts_the_bad_record_and_keeps_len(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW, 40, partitions=2, reader__bad_records="skip", shard__split_rates=[0.5, 0.5], train__global_batch_size=4
    )
    inject(cfg, manifest.topic, 1, b"not an image")
    with make_split_loader(cfg, extended(manifest, 1, 1), "val", 0, 1) as loader:
        batches = drain(loader)
        assert len(batches) == len(loader) == 5
        assert loader.stats.reader.skipped == 1 and loader.stats.padded_records == 1
    seen = Counter(i for b in batches for i in b)
    assert len(seen) == 19 and sum(seen.values()) == 20, "19 good records, one repeated to fill the last batch"


def test_a_skipped_record_counts_once_however_many_epochs_read_it(produce_topic: Produce):
    """Issue 21: skipped_messages counted reads (5 bad records over 2 epochs showed as 10)."""
    cfg, manifest = produce_topic(
        RAW, 40, partitions=2, reader__bad_records="skip", shard__split_rates=[0.5, 0.5], train__global_batch_size=4
    )
    inject(cfg, manifest.topic, 1, b"not an image")
    with make_split_loader(cfg, extended(manifest, 1, 1), "val", 0, 1) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert len(drain(loader)) == 5
        assert loader.stats.reader.skipped == 1


def test_reading_avro_with_the_json_codec_names_the_first_record(produce_topic: Produce):
    cfg, manifest = produce_topic({"format": "avro", "layout": "list", "compression": "none"}, 10, partitions=1)
    json_codec = get_codec("json", "list", manifest.dataset.image_shape)
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, json_codec) as reader:
        with pytest.raises(CorruptRecordError, match=r"does not decode as json/list.*partition=0, offset=0"):
            list(reader.read([OffsetRange(0, 0, 10)]))


def test_schema_fingerprint_mismatch_is_refused_before_reading(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 10, partitions=1)
    stale = manifest.model_copy(update={"schema_fingerprint": "0" * 64})
    with pytest.raises(ManifestMismatchError, match=f"{manifest.topic}.*written with schema 0000"):
        make_split_loader(cfg, stale, "train", 0, 1)


def test_unknown_topic(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 10, partitions=1)
    with make_split_loader(cfg, manifest.model_copy(update={"topic": "no-such-topic"}), "train", 0, 1) as loader:
        with pytest.raises(TopicError, match="topic 'no-such-topic' does not exist"):
            drain(loader)


def test_missing_partition(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 10, partitions=1, shard__split_rates=[1.0])
    extra = manifest.partitions[0].model_copy(update={"partition": 1})
    two = manifest.model_copy(
        update={
            "partitions": [*manifest.partitions, extra],
            "num_messages": 2 * manifest.num_messages,
            "num_records": 2 * manifest.num_records,
        }
    )
    with make_split_loader(cfg, two, "train", 0, 1) as loader:
        with pytest.raises(TopicError, match=r"has no partition\(s\) \[1\]"):
            drain(loader)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_offsets_past_the_end_fail_fast(produce_topic: Produce, client):
    cfg, manifest = produce_topic(RAW, 20, partitions=2, shard__split_rates=[1.0], reader__deadline_s=30)
    started = time.monotonic()
    with make_split_loader(cfg, extended(manifest, 0, 5), "train", 0, 1, client=client) as loader:
        with pytest.raises(
            OffsetRangeError,
            match=r"planned range \[0, 15\) is outside the stored offsets \[0, 10\)"
            r".*partition=0, offset=10",
        ):
            drain(loader)
    assert time.monotonic() - started < 10, "checked up front, not after the read deadline"


@pytest.mark.own_broker
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_broker_stopped_mid_read_times_out_naming_the_position(tmp_path, make_config, client):
    own = EmbeddedBroker(tmp_path / "own-broker", port=free_port())
    own.start()
    try:
        cfg = make_config(
            kafka__embedded__port=own.port,
            kafka__embedded__broker="tansu",
            dataset__num_records=400,
            produce__partitions=1,
            reader__deadline_s=2.0,
            reader__poll_timeout_s=0.2,
            reader__prefetch_batches=1,
            shard__split_rates=[1.0],
            shard__block_records=4,
            train__global_batch_size=2,
        )
        from kbit_core.produce import produce_dataset

        manifest = produce_dataset(cfg, cfg.produce.variant.model_copy(update=RAW), progress=False)
        with make_split_loader(cfg, manifest, "train", 0, 1, client=client) as loader:
            batches = iter(loader)
            next(batches)
            own.stop()
            started = time.monotonic()
            with pytest.raises(
                ReadTimeoutError,
                match=r"no progress for 2s reading planned range .*expecting offset "
                rf"\d+ next.*topic={manifest.topic}, partition=0",
            ) as err:
                for _ in batches:
                    pass
            assert time.monotonic() - started < 20
            assert err.value.offset is not None
    finally:
        own.stop()

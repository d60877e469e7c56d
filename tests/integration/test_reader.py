"""Planner + reader + loader through the real broker: exact ranges, exactly-once audits, resume, prefetch lifecycle."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from kbit_core.data.loader import per_rank_batch_size
from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError
from kbit_core.formats import get_codec
from kbit_core.kafka import offsets
from kbit_core.sharding import OffsetRange
from tests.integration.dataplane_fixtures import READERS, Produce, reader_settings

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]

RAW = {"format": "raw", "layout": "bytes", "compression": "lz4"}


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kbit-loader")]


def split_indices(manifest, cfg, split: str) -> set[int]:
    """Sample indices the plan puts in ``split`` (raw topics are written in index order, message i -> partition
    i % P, so the record at offset o of partition p is sample o * P + p)."""
    from kbit_core.sharding import plan

    num_partitions = len(manifest.partitions)
    p = plan(manifest.ranges(), cfg.shard.split_rates, 1)
    return {o * num_partitions + r.partition for r in p.splits[split] for o in r.offsets()}


@pytest.mark.parametrize("reader", READERS)
def test_reader_yields_exactly_the_requested_ranges(produce_topic: Produce, reader):
    client, fetch = reader_settings(reader)
    cfg, manifest = produce_topic(RAW, 120, partitions=2, reader__max_poll_records=7, **fetch)
    codec = get_codec("raw", "bytes", manifest.dataset.image_shape)
    # contiguous, backwards, across partitions, single offsets, empty
    ranges = [
        OffsetRange(0, 0, 13),
        OffsetRange(0, 13, 40),
        OffsetRange(1, 5, 6),
        OffsetRange(0, 3, 9),
        OffsetRange(1, 59, 60),
        OffsetRange(1, 30, 30),
        OffsetRange(0, 40, 60),
    ]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, client) as reader:
        got = list(reader.read_raw(ranges))
    assert [r for r, _ in got] == [r for r in ranges if len(r)]
    for rng, records in got:
        assert [(x.partition, x.offset) for x in records] == [(rng.partition, o) for o in rng.offsets()]
    assert reader.stats.messages == sum(len(r) for r in ranges) and reader.stats.gaps == 0


@pytest.mark.parametrize("reader", READERS)
def test_fetches_smaller_than_librdkafka_s_default_request_limit_read_every_range(produce_topic: Produce, reader):
    # 4 KiB fetches: five 808-byte records each; librdkafka (the confluent reader, and kafka-python's offset probe)
    # refused any fetch.max.bytes under its 1,000,000-byte message.max.bytes before kbit lowered that with it
    client, fetch = reader_settings(reader)
    cfg, manifest = produce_topic(RAW, 60, partitions=2, reader__fetch_max_bytes=4096, **fetch)
    codec = get_codec("raw", "bytes", manifest.dataset.image_shape)
    ranges = [OffsetRange(p, start, stop) for p, (start, stop) in manifest.ranges().items()]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, client) as reader:
        got = list(reader.read_raw(ranges))
    assert [(x.partition, x.offset) for _, records in got for x in records] == [
        (r.partition, o) for r in ranges for o in r.offsets()
    ]
    assert reader.stats.messages == 60 and reader.stats.gaps == 0


@pytest.mark.parametrize(("partitions", "world_size"), [(2, 2), (1, 2), (3, 2), (4, 3)])
def test_every_sample_is_read_exactly_once_per_split_and_epoch(produce_topic: Produce, partitions, world_size):
    cfg, manifest = produce_topic(
        RAW,
        150,
        partitions=partitions,
        train__global_batch_size=4 * world_size,
        launch__num_processes=world_size,
        shard__block_records=8,
    )
    for split in ("train", "val", "test"):
        expected = split_indices(manifest, cfg, split)
        orders = []
        for epoch in (0, 1):
            seen: Counter[int] = Counter()
            lengths, promised = set(), 0
            for rank in range(world_size):
                with make_split_loader(cfg, manifest, split, rank, world_size, epoch=epoch) as loader:
                    batches = list(loader.iter_indexed())
                    lengths.add((len(loader), len(batches)))
                    assert all(b.x.shape[0] == loader.batch_size for b in batches[:-1])
                    seen.update(i for b in batches for i in b.indices.tolist())
                    promised += loader.num_records
                    assert loader.stats.reader.skipped == loader.stats.padded_records == 0
                    if rank == 0:
                        orders.append([i for b in batches for i in b.indices.tolist()])
            assert len(lengths) == 1, f"{split}: len() differs between ranks: {lengths}"
            ((length, yielded),) = lengths
            assert length == yielded
            assert max(seen.values()) == 1, f"{split} epoch {epoch}: a sample was read twice"
            assert set(seen) <= expected and len(seen) == promised
            # left out: the plan's remainder (< world_size) and, in train, each rank's partial last batch
            tail = world_size * (4 - 1) if split == "train" else 0
            assert len(expected) - len(seen) <= tail + world_size - 1
        if split == "train":
            assert orders[0] != orders[1], "train order changes with the epoch"
        else:
            assert orders[0] == sorted(orders[0], key=lambda i: (i % partitions, i)), "eval keeps offset order"


def test_stream_and_eager_yield_identical_batches(produce_topic: Produce):
    cfg, manifest = produce_topic(
        {"format": "protobuf", "layout": "bytes", "compression": "zstd"},
        90,
        partitions=3,
        shard__block_records=10,
        train__global_batch_size=8,
    )
    runs = {}
    for mode in ("stream", "eager"):
        mode_cfg = cfg.model_copy(update={"reader": cfg.reader.model_copy(update={"mode": mode})})
        with make_split_loader(mode_cfg, manifest, "train", 1, 2, epoch=3) as loader:
            runs[mode] = list(loader.iter_indexed())
            if mode == "eager":
                assert loader.stats.load_seconds > 0
    assert len(runs["stream"]) == len(runs["eager"]) > 0
    for a, b in zip(runs["stream"], runs["eager"]):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


@pytest.mark.parametrize("mode", ["stream", "eager"])
def test_resume_mid_epoch_continues_at_the_next_unseen_batch(produce_topic: Produce, mode):
    cfg, manifest = produce_topic(
        RAW, 140, partitions=2, reader__mode=mode, shard__block_records=9, train__global_batch_size=6
    )
    with make_split_loader(cfg, manifest, "train", 0, 2, epoch=1) as loader:
        full = [b.indices.tolist() for b in loader.iter_indexed()]
        batches = loader.iter_indexed()
        head = [next(batches).indices.tolist() for _ in range(4)]
        state = loader.state_dict()
        batches.close()
    assert state["batches_done"] == 4 and state["epoch"] == 1 and state["world_size"] == 2
    with make_split_loader(cfg, manifest, "train", 0, 2) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # a training loop calls this at the top of the resumed epoch: it must not rewind
        tail = [b.indices.tolist() for b in resumed.iter_indexed()]
        assert resumed.batches_done == len(resumed)
    assert head + tail == full, "no batch missing, none repeated, same order"


def test_load_state_dict_rejects_a_different_world_size_or_plan(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 60, partitions=2)
    with make_split_loader(cfg, manifest, "train", 0, 2) as loader:
        state = loader.state_dict()
    with make_split_loader(cfg, manifest, "train", 0, 1) as other_world:
        with pytest.raises(ConfigError, match="saved with world size 2, this run has 1"):
            other_world.load_state_dict(state)
    other_rates = cfg.model_copy(update={"shard": cfg.shard.model_copy(update={"split_rates": [0.5, 0.5]})})
    with make_split_loader(other_rates, manifest, "train", 0, 2) as replanned:
        with pytest.raises(ConfigError, match="shard plan changed"):
            replanned.load_state_dict(state)
        with pytest.raises(ConfigError, match="version"):
            replanned.load_state_dict({**state, "version": 99})
    with make_split_loader(cfg, manifest.model_copy(update={"topic": "another-topic"}), "train", 0, 2) as moved:
        with pytest.raises(ConfigError, match="shard plan changed"):
            moved.load_state_dict(state)


def test_pad_keeps_len_equal_when_the_split_does_not_divide(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW,
        31,
        partitions=3,
        shard__remainder="pad",
        shard__split_rates=[1.0],
        train__global_batch_size=3,
        launch__num_processes=3,
    )
    seen: Counter[int] = Counter()
    lengths = []
    for rank in range(3):
        with make_split_loader(cfg, manifest, "train", rank, 3) as loader:
            lengths.append(len(list(loader)))
            seen.update(i for b in loader.iter_indexed() for i in b.indices.tolist())
    assert lengths == [11, 11, 11]
    assert set(seen) == set(range(31)) and sum(seen.values()) == 33


def test_early_break_and_close_stop_the_prefetch_thread(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW,
        200,
        partitions=1,
        reader__prefetch_batches=1,
        shard__block_records=16,
        train__global_batch_size=2,
        shard__split_rates=[1.0],
    )
    with make_split_loader(cfg, manifest, "train", 0, 1) as loader:
        for i, (_x, _y) in enumerate(loader):
            if i == 3:
                break
        assert not loader_threads(), "breaking out of the loop stops the worker thread"
        assert loader.stats.batches == 4 and loader.stats.wait_seconds > 0
        assert sum(1 for _ in loader) == len(loader) == 100, "a fresh iteration starts the epoch again"
        assert loader.stats.reader.fetch_seconds > 0 and loader.stats.reader.decode_seconds > 0
    assert not loader_threads()


def test_set_epoch_reshuffles_train_only(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 120, partitions=2, shard__block_records=5, train__global_batch_size=4)
    with make_split_loader(cfg, manifest, "train", 0, 1) as train, make_split_loader(cfg, manifest, "val", 0, 1) as val:
        orders = {}
        for epoch in (0, 1):
            train.set_epoch(epoch)
            val.set_epoch(epoch)
            orders[epoch] = (
                [b.indices.tolist() for b in train.iter_indexed()],
                [b.indices.tolist() for b in val.iter_indexed()],
            )
    assert orders[0][0] != orders[1][0] and sorted(sum(orders[0][0], [])) == sorted(sum(orders[1][0], []))
    assert orders[0][1] == orders[1][1]


def test_per_rank_batch_size_refuses_zero_and_warns_on_truncation(caplog):
    assert per_rank_batch_size(64, 2) == 32
    with pytest.raises(ConfigError, match="global_batch_size=1 gives 0 samples per rank on 2 ranks"):
        per_rank_batch_size(1, 2)
    with caplog.at_level("WARNING"):
        assert per_rank_batch_size(32, 3) == 10
    assert "does not divide by 3 ranks: 10 per rank, 30 globally" in caplog.text


def test_unknown_split_or_rank_is_a_config_error(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 20, partitions=1, shard__split_rates=[0.5, 0.5])
    with pytest.raises(ConfigError, match="unknown split 'test'"):
        make_split_loader(cfg, manifest, "test", 0, 1)
    with pytest.raises(ConfigError, match="rank 2 is outside world size 2"):
        make_split_loader(cfg, manifest, "train", 2, 2)


def append_transaction(cfg, topic: str, partition: int, values: list[bytes]) -> list[int]:
    """Produce ``values`` to ``partition`` in one committed transaction: the commit marker takes the offset after
    them, the log's last, and no consumer ever delivers it. Returns the values' offsets."""
    from confluent_kafka import Producer

    written: list[int] = []
    producer = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap(), "transactional.id": f"kbit-{topic}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value, partition=partition, on_delivery=lambda err, msg: written.append(msg.offset()))
    producer.flush(30)
    producer.commit_transaction(30)
    # Apache Kafka's coordinator writes the commit marker after commit_transaction returned (Tansu before): the log
    # ends past the marker only then
    deadline = time.monotonic() + 30
    while offsets.exact_end_offsets(cfg.kafka, topic)[partition] < written[-1] + 2:
        assert time.monotonic() < deadline, f"the commit marker did not reach {topic}[{partition}] within 30 s"
        time.sleep(0.05)
    return written


@pytest.mark.parametrize("reader", READERS)
def test_offsets_missing_at_the_end_of_a_range_are_counted_as_gaps(produce_topic: Produce, reader):
    # A range whose last offsets never arrive (a transaction marker at the log end; compaction likewise) must end
    # with those offsets counted as gaps, not wait out the reader's deadline.
    client, fetch = reader_settings(reader)
    cfg, manifest = produce_topic(RAW, 20, partitions=1, reader__deadline_s=10.0, **fetch)
    codec = get_codec("raw", "bytes", manifest.dataset.image_shape)
    end = manifest.partitions[0].stop_offset
    extra = codec.encode(
        *[a[:2] for a in (np.arange(2), np.zeros((2, *codec.image_shape), np.uint8), np.zeros(2, np.int64))]
    )
    assert append_transaction(cfg, manifest.topic, 0, extra) == [end, end + 1]
    log_end = end + 3  # the two records and the commit marker
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, client) as reader:
        t0 = time.monotonic()
        ((rng, records),) = list(reader.read_raw([OffsetRange(0, end - 5, log_end)]))
        elapsed = time.monotonic() - t0
        assert [r.offset for r in records] == list(range(end - 5, end + 2))
        assert reader.stats.gaps == 1 and reader.stats.messages == 7
        assert elapsed < cfg.reader.deadline_s / 2, f"waited {elapsed:.1f}s for the marker"
        # the same offsets in the middle of a longer read: counted once more, nothing else lost
        got = list(reader.read_raw([OffsetRange(0, end + 1, log_end), OffsetRange(0, 0, 3)]))
        assert [[r.offset for r in recs] for _, recs in got] == [[end + 1], [0, 1, 2]]
        assert reader.stats.gaps == 2


def test_records_left_out_with_several_records_per_message_are_counted(produce_topic: Produce):
    # 43 records in groups of 4: the last message holds 3, so every rank yields what the rank holding it can,
    # and the records the others read past that are counted, not silently dropped.
    cfg, manifest = produce_topic(
        {**RAW, "records_per_message": 4}, 43, partitions=2, train__global_batch_size=2, shard__split_rates=[1.0]
    )
    codec = get_codec("raw", "bytes", manifest.dataset.image_shape, 4)
    yielded = left_out = held = 0
    for rank in range(2):
        with make_split_loader(cfg, manifest, "train", rank, 2) as loader:
            yielded += sum(len(y) for _, y in loader)
            assert loader.stats.left_out_records == loader.left_out_records
            left_out += loader.stats.left_out_records
            with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
                held += sum(len(batch) for _, batch in reader.read(loader.shard.ranges))
    assert held == 39  # 10 of the 11 messages planned (the remainder leaves one full message out): 20 + 19 records
    assert yielded + left_out == held and left_out == 1  # both shards yield 19

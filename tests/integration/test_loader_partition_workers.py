"""reader.workers=partitions through the real broker: the thread mode's batches, order and resume from one worker
process per partition group, the workers kept across epochs, and a dead worker named in one line."""

from __future__ import annotations

import os
import re
import signal

import pytest

from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import KbitError
from tests.conftest import loader_workers
from tests.integration.dataplane_fixtures import RAW, Produce
from tests.integration.test_loader_workers import AVRO_LIST, assert_same, batches_of, with_workers

pytestmark = pytest.mark.kafka


def with_partition_workers(cfg, workers: int):
    return with_workers(cfg, "partitions").override({"reader.partition_workers": workers})


@pytest.mark.parametrize(
    ("variant", "workers"), [(RAW, 0), (AVRO_LIST, 2)], ids=["raw_bytes_per_partition", "avro_list_two_workers"]
)
def test_partition_workers_yield_the_thread_batches_and_resume_alike(produce_topic: Produce, variant, workers):
    cfg, manifest = produce_topic(
        variant, 150, partitions=3, shard__block_records=10, train__global_batch_size=6, reader__prefetch_batches=2
    )
    runs = {}
    for name, mode_cfg in (("thread", cfg), ("partitions", with_partition_workers(cfg, workers))):
        with (
            make_split_loader(mode_cfg, manifest, "train", 1, 2, epoch=3) as train,
            make_split_loader(mode_cfg, manifest, "val", 1, 2, epoch=3) as val,
        ):
            runs[name] = (batches_of(train), batches_of(val))
            assert train.stats.batches == len(train) and train.stats.reader.decode_seconds > 0
            assert train.stats.reader.messages == train.shard.num_records
            assert train.stats.reader.skipped == train.stats.padded_records == 0
    for got, expected in zip(runs["partitions"], runs["thread"]):
        assert len(got) > 0
        assert_same(got, expected)

    with make_split_loader(with_partition_workers(cfg, workers), manifest, "train", 1, 2, epoch=3) as loader:
        batches = loader.iter_indexed()
        head = [next(batches).indices.tolist() for _ in range(5)]
        state = loader.state_dict()
        batches.close()
        loader.set_epoch(4)
        assert len(batches_of(loader)) == len(loader)
        started = loader_workers()
        groups = {r.partition % (workers or len(manifest.partitions)) for r in loader.shard.ranges if len(r)}
        assert len(started) == len(groups) >= 2, "one worker process per partition group the loader reads"
        loader.set_epoch(5)
        assert len(batches_of(loader)) == len(loader)
        assert loader_workers() == started, "the same worker processes (and consumers) serve the loader's epochs"
    assert not loader_workers(), "closing the loader ends its worker processes"
    with make_split_loader(with_partition_workers(cfg, workers), manifest, "train", 1, 2) as resumed:
        resumed.load_state_dict(state)
        tail = batches_of(resumed)
    assert head == [i for i, _, _ in runs["thread"][0][:5]]
    assert_same(tail, runs["thread"][0][5:])


def test_a_dead_partition_worker_is_a_one_line_error_naming_it(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW, 400, partitions=2, shard__block_records=8, train__global_batch_size=2, shard__split_rates=[1.0]
    )
    with make_split_loader(with_partition_workers(cfg, 0), manifest, "train", 0, 1) as loader:
        batches = loader.iter_indexed()
        next(batches)
        for worker in loader_workers():
            os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(KbitError) as err:
            for _ in batches:
                pass
    message = str(err.value)
    assert "\n" not in message
    named = (
        rf"^loader worker process [01] of rank 0 split train \(partitions [01] of topic {re.escape(manifest.topic)}\)"
    )
    # DataLoader's status check, or the dead worker's shared memory or its socket (refused, or reset mid-transfer),
    # whichever the rank meets first
    died = (
        r"(DataLoader worker \(pid\(s\) \d+\) exited unexpectedly|EOFError"
        r"|\[Errno \d+\] Connection (refused|reset by peer))"
    )
    assert re.match(named + rf" failed: {died}$", message), message
    assert not loader_workers()


def test_an_elastic_resume_reads_the_thread_modes_batches(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 150, partitions=2, shard__block_records=7, train__global_batch_size=6)
    states = []
    for rank in (0, 1):  # the interrupted epoch: 2 ranks, each 5 batches in
        with make_split_loader(cfg, manifest, "train", rank, 2, epoch=1) as old:
            batches = old.iter_indexed()
            for _ in range(5):
                next(batches)
            states.append(old.state_dict())
            batches.close()
    rest = {}
    for name, mode_cfg in (("thread", cfg), ("partitions", with_partition_workers(cfg, 0))):
        with make_split_loader(mode_cfg, manifest, "train", 2, 3) as new:
            new.set_epoch(1)
            new.load_state_dict({"resharded_from": states})
            rest[name] = [b.indices.tolist() for b in new.iter_indexed()]
    assert rest["partitions"] == rest["thread"] and rest["thread"]

"""reader.workers=process (and, where the test applies to both, partitions) through the real broker: the thread mode's batches, errors and counts, from a child
process that leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
import torch

from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import CorruptRecordError
from kbit_core.train.rank_data import rank_loaders
from tests.conftest import loader_workers
from tests.integration.dataplane_fixtures import RAW, Produce, extended, inject

pytestmark = pytest.mark.kafka

AVRO_LIST = {"format": "avro", "layout": "list", "compression": "lz4"}


def with_workers(cfg, workers: str):
    return cfg.model_copy(update={"reader": cfg.reader.model_copy(update={"workers": workers})})


def batches_of(loader) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    return [(b.indices.tolist(), b.x, b.y) for b in loader.iter_indexed()]


def assert_same(got, expected) -> None:
    assert [i for i, _, _ in got] == [i for i, _, _ in expected], "same samples in the same order"
    for (_, x, y), (_, ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


@pytest.mark.parametrize("variant", [RAW, AVRO_LIST], ids=["raw_bytes", "avro_list"])
def test_process_workers_yield_the_thread_batches_and_resume_alike(produce_topic: Produce, variant):
    cfg, manifest = produce_topic(
        variant, 150, partitions=3, shard__block_records=10, train__global_batch_size=6, reader__prefetch_batches=2
    )
    runs = {}
    for workers in ("thread", "process"):
        mode_cfg = with_workers(cfg, workers)
        with (
            make_split_loader(mode_cfg, manifest, "train", 1, 2, epoch=3) as train,
            make_split_loader(mode_cfg, manifest, "val", 1, 2, epoch=3) as val,
        ):
            runs[workers] = (batches_of(train), batches_of(val))
            assert train.stats.reader.messages >= train.num_records and train.stats.reader.decode_seconds > 0
            assert train.stats.batches == len(train) and train.stats.reader.skipped == train.stats.padded_records == 0
    for got, expected in zip(runs["process"], runs["thread"]):
        assert len(got) > 0
        assert_same(got, expected)

    process_cfg = with_workers(cfg, "process")
    with make_split_loader(process_cfg, manifest, "train", 1, 2, epoch=3) as loader:
        batches = loader.iter_indexed()
        head = [next(batches).indices.tolist() for _ in range(5)]
        state = loader.state_dict()
        batches.close()
        (worker,) = loader_workers()
        loader.set_epoch(4)
        assert len(batches_of(loader)) == len(loader)
        assert loader_workers() == [worker], "one worker process (and consumer) serves the loader's epochs"
    assert not loader_workers(), "closing the loader ends its worker process"
    with make_split_loader(process_cfg, manifest, "train", 1, 2) as resumed:
        resumed.load_state_dict(state)
        tail = batches_of(resumed)
    assert head == [i for i, _, _ in runs["thread"][0][:5]]
    assert_same(tail, runs["thread"][0][5:])


@pytest.mark.parametrize("workers", ["process", "partitions"])
def test_a_corrupt_record_fails_in_the_rank_with_its_coordinates(produce_topic: Produce, workers):
    cfg, manifest = produce_topic(
        RAW, 40, partitions=2, reader__workers=workers, shard__split_rates=[0.5, 0.5], train__global_batch_size=4
    )
    offset = inject(cfg, manifest.topic, 1, b"\x00garbage")
    with make_split_loader(cfg, extended(manifest, 1, 1), "val", 0, 1) as loader:
        with pytest.raises(CorruptRecordError, match=r"does not decode as raw/bytes") as err:
            batches_of(loader)
    assert (err.value.topic, err.value.partition, err.value.offset) == (manifest.topic, 1, offset)
    assert str(err.value).endswith(f"(topic={manifest.topic}, partition=1, offset={offset})")
    assert any("raised in the worker process" in note for note in err.value.__notes__)
    assert not loader_workers()


@pytest.mark.parametrize("workers", ["process", "partitions"])
def test_skipped_records_reach_the_rank_counts(produce_topic: Produce, workers):
    cfg, manifest = produce_topic(
        RAW,
        40,
        partitions=2,
        reader__bad_records="skip",
        reader__workers=workers,
        shard__split_rates=[0.5, 0.5],
        train__global_batch_size=4,
    )
    inject(cfg, manifest.topic, 1, b"not an image")
    with make_split_loader(cfg, extended(manifest, 1, 1), "val", 0, 1) as loader:
        batches = [i for i, _, _ in batches_of(loader)]
        assert len(batches) == len(loader) == 5
        assert loader.stats.reader.skipped == 1 and loader.stats.padded_records == 1
        assert loader.stats.reader.messages == 20 and loader.stats.reader.records == 19
    seen = Counter(i for b in batches for i in b)
    assert len(seen) == 19 and sum(seen.values()) == 20, "19 good records, one repeated to fill the last batch"


@pytest.mark.parametrize("mode", ["process", "partitions"])
def test_split_loaders_sharing_a_reader_read_alike_in_process_mode(produce_topic: Produce, mode):
    cfg, manifest = produce_topic(RAW, 120, partitions=2, shard__block_records=8, train__global_batch_size=4)
    runs = {}
    for workers in ("thread", mode):
        loaders = rank_loaders(with_workers(cfg, workers), manifest, 0, 1, share_reader=True)
        try:
            loaders.shared.connect()
            runs[workers] = {split: batches_of(loader) for split, loader in loaders.splits().items()}
            reader_counts = loaders.shared.reader.stats
            assert reader_counts.messages == sum(loader.stats.records for loader in loaders.splits().values())
        finally:
            loaders.close()
    for split, expected in runs["thread"].items():
        assert_same(runs[mode][split], expected)


RANK_SCRIPT = """
import json, sys
from kbit_core.config import KbitConfig
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.kafka.manifest import Manifest
cfg = KbitConfig.model_validate_json(sys.argv[1])
manifest = Manifest.model_validate_json(sys.argv[2])
loader = make_split_loader(cfg, manifest, "train", 0, 1)
batches = loader.iter_indexed()
next(batches)
print("first batch", flush=True)
sys.stdin.read()  # killed while its worker process waits for the next request
"""


def test_the_worker_process_ends_when_the_rank_is_killed(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW,
        400,
        partitions=1,
        reader__workers="process",
        shard__block_records=8,
        train__global_batch_size=2,
        shard__split_rates=[1.0],
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, cfg.model_dump_json(), manifest.model_dump_json()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout.readline().strip() == "first batch"
        rank_process = psutil.Process(rank.pid)
        descendants = rank_process.children(recursive=True)
        assert loader_workers(rank_process), "the rank reads through a worker process"
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        deadline = time.monotonic() + 60  # the worker checks on its parent every 5 s
        while time.monotonic() < deadline and any(alive(p) for p in descendants):
            time.sleep(0.5)
        assert not [p for p in descendants if alive(p)], "no process of the killed rank outlives it"
    finally:
        if rank.poll() is None:
            rank.kill()


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

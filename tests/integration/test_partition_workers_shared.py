"""reader.workers=partitions through the real broker: a rank's loaders of every split share one set of worker
processes, started once and kept across epochs and splits; a loader iterated while another holds them gets its own."""

from __future__ import annotations

import pytest

from kbit_core.train.rank_data import rank_loaders
from tests.conftest import loader_workers
from tests.integration.dataplane_fixtures import RAW, Produce

pytestmark = pytest.mark.kafka


def test_the_splits_of_a_rank_share_its_partition_workers_across_epochs(produce_topic: Produce):
    cfg, manifest = produce_topic(
        RAW, 120, partitions=2, shard__block_records=8, train__global_batch_size=4, reader__workers="partitions"
    )
    loaders = rank_loaders(cfg, manifest, 0, 1, share_reader=False)
    started = None
    try:
        for epoch in (0, 1):
            for split in ("train", "val", "test"):
                loader = getattr(loaders, split)
                loader.set_epoch(epoch)
                assert len(list(loader)) == len(loader) > 0
                workers = {p.pid for p in loader_workers()}
                started = started or workers
                assert workers == started, f"{split} epoch {epoch} started worker processes of its own"
        assert len(started) == 2, "one worker process per partition for the whole rank"
        assert loaders.train.stats.reader.messages == 2 * loaders.train.shard.num_records
        assert loaders.val.stats.reader.messages == 2 * loaders.val.shard.num_records

        train, val = iter(loaders.train), iter(loaders.val)  # interleaved: val cannot wait for train's workers
        assert len([next(train), *val]) == 1 + len(loaders.val)
        assert len(loader_workers()) == 4 and {p.pid for p in loader_workers()} >= started
        assert len(list(train)) == len(loaders.train) - 1
    finally:
        loaders.close()
    assert not loader_workers(), "the last loader to close ends the rank's worker processes"

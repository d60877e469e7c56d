"""reader.workers=process (and partitions) in a rank that has CUDA initialised: the worker (forked from a forkserver that never
touched CUDA) streams the thread mode's batches, pinned here, and ends with the loader."""

from __future__ import annotations

import pytest
import torch

from kbit_core.data.split_loaders import make_split_loader
from tests.conftest import loader_workers
from tests.integration.dataplane_fixtures import RAW, Produce, produce_topic

__all__ = ["produce_topic"]  # the fixture

pytestmark = [pytest.mark.gpu, pytest.mark.kafka]


@pytest.mark.parametrize("mode", ["process", "partitions"])
def test_process_workers_feed_a_rank_with_cuda_initialised(produce_topic: Produce, mode):
    cfg, manifest = produce_topic(
        RAW, 200, partitions=2, launch__use_gpu=True, train__global_batch_size=16, shard__block_records=32
    )
    on_gpu = torch.ones(1, device="cuda")  # CUDA is initialised before the worker process starts
    runs = {}
    for workers in ("thread", mode):
        mode_cfg = cfg.model_copy(update={"reader": cfg.reader.model_copy(update={"workers": workers})})
        with make_split_loader(mode_cfg, manifest, "train", 0, 1, epoch=1) as loader:
            batches = list(loader.iter_indexed())
            assert all(b.x.is_pinned() and b.y.is_pinned() for b in batches)
            runs[workers] = [(b.indices, (b.x.to("cuda", non_blocking=True) * on_gpu).cpu()) for b in batches]
    assert len(runs[mode]) == len(runs["thread"]) > 0
    for (indices, x), (thread_indices, thread_x) in zip(runs[mode], runs["thread"]):
        assert torch.equal(indices, thread_indices) and torch.equal(x, thread_x)
    assert not loader_workers(), "the worker ended with its loader"

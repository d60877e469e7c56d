"""TorchDistributor launches through kbit_core.launch: results, worker errors, bad environments, no debris."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import DistributedError
from kbit_core.launch.distributor import WorkerFailedError, errors_dir, run_distributed
from kbit_core.launch.spark import worker_tmp_dir

pytestmark = [pytest.mark.spark]


def rank_report(cfg: KbitConfig, delay_rank0_s: float) -> dict[str, int]:
    """All-reduce the ranks, tear the group down, and return this rank's view.

    Rank 0 finishes last on purpose: without the launcher's rank-0 hand-off, the other rank's
    value would be the last one written and come back to the driver.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        time.sleep(delay_rank0_s)
    return {
        "rank": rank,
        "world_size": world_size,
        "rank_sum": int(total.item()),
        "pid": os.getpid(),
        "profile": cfg.profile,
    }


def fail_on_rank(cfg: KbitConfig, bad_rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        if dist.get_rank() == bad_rank:
            raise ValueError(f"batch 7 has 3 labels for 4 images on rank {bad_rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("local_mode", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_every_rank_returns_rank0_result(spark, make_config, audited_tmpdir, launch_debris, local_mode):
    cfg = make_config(launch__local_mode=local_mode)
    result = run_distributed(rank_report, cfg, 1.0)
    assert {k: result[k] for k in ("rank", "world_size", "rank_sum", "profile")} == {
        "rank": 0,
        "world_size": 2,
        "rank_sum": 1,
        "profile": cfg.profile,
    }
    assert result["pid"] != os.getpid()
    assert launch_debris(audited_tmpdir, cfg.run_dir, worker_tmp_dir()) == []


@pytest.mark.parametrize("local_mode", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_worker_exception_reaches_driver_with_its_traceback(
    spark, make_config, audited_tmpdir, launch_debris, local_mode
):
    cfg = make_config(launch__local_mode=local_mode)
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(fail_on_rank, cfg, 1)
    assert (info.value.rank, info.value.exception_type) == ("rank1", "ValueError")
    message = str(info.value)
    assert "rank1 on host localhost raised:" in message and info.value.host == "localhost"
    assert "ValueError: batch 7 has 3 labels for 4 images on rank 1" in message
    assert "\n" not in message and "in fail_on_rank" in info.value.details  # the traceback: only with --debug
    assert "ValueError" in (errors_dir(cfg.run_dir) / "rank1.txt").read_text()
    assert launch_debris(audited_tmpdir, cfg.run_dir, worker_tmp_dir()) == []


def test_more_barrier_tasks_than_slots_is_refused_before_launch(spark, make_config):
    cfg = make_config(
        launch__local_mode=False, launch__num_processes=3, launch__master="local[4]", train__global_batch_size=64
    )
    started = time.monotonic()
    with pytest.raises(
        DistributedError, match=r"needs 3 concurrent barrier tasks .*SparkSession \(local\[2\]\) has 2 slot"
    ):
        run_distributed(rank_report, cfg, 0.0)
    assert time.monotonic() - started < 10


def test_gpu_launch_without_gpu_resources_is_a_clear_error(spark, make_config):
    cfg = make_config(launch__use_gpu=True)
    with pytest.raises(DistributedError, match="TorchDistributor refused launch settings .*use_gpu=True.*GPU"):
        run_distributed(rank_report, cfg, 0.0)

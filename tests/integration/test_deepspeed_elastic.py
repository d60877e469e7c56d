"""DeepSpeed ZeRO elastic resume: a mid-epoch checkpoint of 2 ranks resumes on 1 and on 3 ranks through DeepSpeed's
universal checkpoint, Adam moments and all. Fed the same global batches, the resumed run's loss curve is the
uninterrupted one's to float tolerance (a resume without the moments would take Adam's first, sign-sized step again)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kbit_core.config import KbitConfig
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.deepspeed_checkpoint import UNIVERSAL_TAG
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.worker import run_worker
from tests.conftest import free_port
from tests.integration.test_train_worker import (
    IMAGE_SHAPE,
    NUM_CLASSES,
    SPLIT_SIZES,
    MemoryShardLoader,
    make_split,
    train_config,
)

# 6 records a rank at 2 ranks, 12 at 1, 4 at 3: every world size tried divides it.
GLOBAL_BATCH = 12
STEPS, CHECKPOINT_AT = 12, 5


class ElasticMemoryLoader(MemoryShardLoader):
    """Rank r of W takes every W-th sample of the epoch's permutation, so batch b of all ranks together is the same
    samples at any W that divides the global batch: a run resumed at another world size trains the uninterrupted
    run's global batches, and its loss curve can be compared step by step."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Stands in for ShardLoader's re-plan of the epoch's rest: every old rank stood at the same batch.
        super().load_state_dict(state["resharded_from"][0] if "resharded_from" in state else state)


def elastic_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
    per_rank = cfg.train.global_batch_size // env.world_size
    return SplitLoaders(
        **{
            split: ElasticMemoryLoader(*make_split(split), per_rank, env.rank, env.world_size, cfg.shard.seed)
            for split in SPLIT_SIZES
        }
    )


def _rank_main(rank: int, world_size: int, port: int, config: dict[str, Any], run_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    result = run_worker(KbitConfig.from_dict(config), run_dir, elastic_loaders, IMAGE_SHAPE, NUM_CLASSES)
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps(result))


def train(world_size: int, config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Rank 0's result of training ``config`` on ``world_size`` spawned gloo ranks."""
    run_dir.mkdir(parents=True)
    config = KbitConfig.from_dict(config).override({"launch.num_processes": world_size}).to_secret_dict()
    mp.spawn(_rank_main, args=(world_size, free_port(), config, str(run_dir)), nprocs=world_size, join=True)
    return json.loads((run_dir / "rank0.json").read_text())


@pytest.mark.slow
# Each spawn costs seconds of DeepSpeed imports, so the suite resumes ZeRO-2 on 1 rank and ZeRO-3 on 3 (ZeRO-2 on 3 is
# test_elastic_resume.py's broker audit; ZeRO-1 converts as ZeRO-2 does); docs/training.md has every stage at both.
@pytest.mark.parametrize(("stage", "world_sizes"), [(2, (1,)), (3, (3,))], ids=["zero2-on1", "zero3-on3"])
def test_zero_checkpoint_of_two_ranks_resumes_on_one_and_three_with_its_adam_moments(
    tmp_path: Path, stage: int, world_sizes: tuple[int, ...]
) -> None:
    sections = {
        "train": {"epochs": 1, "global_batch_size": GLOBAL_BATCH, "max_steps_per_epoch": STEPS},
        "deepspeed": {"enabled": True, "zero_stage": stage},
    }
    whole = train(
        2,
        train_config(tmp_path, **sections, checkpoint={"dir": "ckpt", "every_steps": CHECKPOINT_AT}),
        tmp_path / "two",
    )
    mid = ckpt.list_lineages(tmp_path / "two" / "ckpt")[0] / ckpt.checkpoint_name(CHECKPOINT_AT)
    assert whole["steps"] == STEPS and whole["engine"] == f"deepspeed-zero{stage}"
    for world_size in world_sizes:
        resumed = train(
            world_size,
            train_config(tmp_path, **sections, checkpoint={"dir": "ckpt", "resume": str(mid)}),
            tmp_path / f"on{world_size}",
        )
        assert resumed["world_size"] == world_size and resumed["steps"] == STEPS
        # The first 5 losses are the checkpoint's; the 7 after it were trained at the new world size.
        np.testing.assert_allclose(resumed["loss_curve"], whole["loss_curve"], rtol=1e-5, atol=1e-6)
        assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)
    # Converted by rank 0 into the checkpoint directory, nothing of the staging left beside it.
    universal = mid / UNIVERSAL_TAG
    assert (universal / "zero" / "optimizer_state.pt").is_file()
    assert sorted(p.name for p in mid.iterdir() if p.name.startswith(".") or p.name.startswith("latest")) == []

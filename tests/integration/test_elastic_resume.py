"""Elastic resume in batch mode: an epoch interrupted at world size 2 continues at 1 and at 3, re-planned so every
record the epoch yields is trained exactly once (the audit), through the real broker."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from kbit_core.config import KbitConfig
from kbit_core.data.loader import ShardLoader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError
from kbit_core.kafka.manifest import Manifest
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.rank_data import rank_loaders
from kbit_core.train.worker import run_worker
from tests.conftest import free_port
from tests.integration.dataplane_fixtures import RAW, Produce

pytestmark = [pytest.mark.kafka]

OLD_WORLD, DONE = 2, 5  # the interrupted epoch: 2 ranks, each 5 batches in


def epoch_indices(loaders) -> list[list[list[int]]]:
    """Each loader's batches (as sample-index lists) for the rest of its epoch."""
    return [[batch.indices.tolist() for batch in loader.iter_indexed()] for loader in loaders]


@pytest.mark.parametrize(("new_world", "mode"), [(1, "eager"), (3, "stream")])
def test_an_epoch_interrupted_at_two_ranks_finishes_at_another_world_size_exactly_once(
    produce_topic: Produce, mode: str, new_world: int
) -> None:
    cfg, manifest = produce_topic(
        RAW, 150, partitions=2, reader__mode=mode, shard__block_records=7, train__global_batch_size=6
    )
    with ExitStack() as stack:
        old = [stack.enter_context(make_split_loader(cfg, manifest, "train", r, OLD_WORLD, epoch=1)) for r in (0, 1)]
        whole_epoch = [i for batches in epoch_indices(old) for batch in batches for i in batch]
        heads, states = [], []
        for loader in old:
            loader.set_epoch(1)
            batches = loader.iter_indexed()
            heads += [i for _ in range(DONE) for i in next(batches).indices.tolist()]
            states.append(loader.state_dict())
            batches.close()
        new = [stack.enter_context(make_split_loader(cfg, manifest, "train", r, new_world)) for r in range(new_world)]
        for loader in new:
            loader.set_epoch(1)
            loader.load_state_dict({"resharded_from": states})
            loader.set_epoch(1)  # the loop's call at the top of the resumed epoch keeps the resume point
        rest = epoch_indices(new)

    # The audit: what the old ranks trained before the checkpoint and the new ranks after it is the epoch, each
    # record once, nothing the epoch would not have yielded.
    trained = Counter(heads + [i for batches in rest for batch in batches for i in batch])
    assert sorted(trained) == sorted(whole_epoch) and set(trained.values()) == {1}
    # Equal steps on every new rank (DDP's collectives), each batch at most the new per-rank size.
    (steps,) = {len(batches) for batches in rest}
    assert all(len(loader) == DONE + steps for loader in new)
    per_rank = cfg.train.global_batch_size // new_world
    assert all(0 < len(batch) <= per_rank for batches in rest for batch in batches)
    # The next epoch is planned for the new world size as usual.
    new[0].set_epoch(2)
    assert new[0].schedule.resharded is None and len(new[0]) == new[0].schedule.num_records // per_rank


def test_a_checkpoint_inside_the_resharded_epoch_resumes_it_at_the_same_world_size(produce_topic: Produce) -> None:
    cfg, manifest = produce_topic(RAW, 150, partitions=2, shard__block_records=7, train__global_batch_size=6)
    with ExitStack() as stack:
        old = [stack.enter_context(make_split_loader(cfg, manifest, "train", r, OLD_WORLD)) for r in (0, 1)]
        states = []
        for loader in old:
            batches = loader.iter_indexed()
            for _ in range(DONE):
                next(batches)
            states.append(loader.state_dict())
            batches.close()
        first = stack.enter_context(make_split_loader(cfg, manifest, "train", 0, 1))
        first.load_state_dict({"resharded_from": states})
        full = [b.indices.tolist() for b in first.iter_indexed()]
        first.load_state_dict({"resharded_from": states})
        batches = first.iter_indexed()
        head = [next(batches).indices.tolist() for _ in range(3)]
        saved = first.state_dict()
        batches.close()
        again = stack.enter_context(make_split_loader(cfg, manifest, "train", 0, 1))
        again.load_state_dict(saved)
        assert head + [b.indices.tolist() for b in again.iter_indexed()] == full
        twice = stack.enter_context(make_split_loader(cfg, manifest, "train", 0, 3))
        with pytest.raises(ConfigError, match="second world-size change"):
            twice.load_state_dict({"resharded_from": [saved]})


class RecordingLoader:
    """A rank's train ShardLoader that appends each batch it yields, as [epoch, batch, sample indices], to a file."""

    def __init__(self, loader: ShardLoader, record: Path) -> None:
        self.loader, self.record, self.stats = loader, record, loader.stats

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader.iter_indexed():
            with self.record.open("a") as f:
                f.write(json.dumps([self.loader.epoch, self.loader.batches_done - 1, batch.indices.tolist()]) + "\n")
            yield batch.x, batch.y

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


def _rank_main(rank: int, world_size: int, port: int, config: dict[str, Any], manifest_json: str, run_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    manifest = Manifest.model_validate_json(manifest_json)

    def recording_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
        loaders = rank_loaders(cfg, manifest, env.rank, env.world_size, share_reader=False)
        loaders.train = RecordingLoader(loaders.train, Path(run_dir, f"trained-rank{env.rank}.jsonl"))
        return loaders

    image_shape, classes = manifest.dataset.image_shape, manifest.dataset.num_classes
    result = run_worker(KbitConfig.from_dict(config), run_dir, recording_loaders, image_shape, classes)
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps(result))


def train_ranks(world_size: int, cfg: KbitConfig, manifest: Manifest, run_dir: Path) -> tuple[dict[str, Any], list]:
    """Train on ``world_size`` spawned gloo ranks: rank 0's result and every (epoch, batch, indices) trained."""
    run_dir.mkdir(parents=True)
    config = cfg.override({"launch.num_processes": world_size}).to_secret_dict()
    args = (world_size, free_port(), config, manifest.model_dump_json(), str(run_dir))
    mp.spawn(_rank_main, args=args, nprocs=world_size, join=True)
    trained = [
        json.loads(line) for path in run_dir.glob("trained-rank*.jsonl") for line in path.read_text().splitlines()
    ]
    return json.loads((run_dir / "rank0.json").read_text()), trained


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "deepspeed-zero2"])
def test_checkpoint_of_two_ranks_resumes_mid_epoch_on_three(produce_topic: Produce, tmp_path: Path, engine: str):
    """The trainer end to end, under DDP and under DeepSpeed ZeRO-2 (its checkpoint converted to a universal one):
    2 ranks write a checkpoint 5 steps into the epoch; resumed from it on 3 ranks (and on 1: the loader tests above
    cover that re-plan; here it would add a third spawn), the epoch's samples before it (trained by the 2) and after
    it (by the 3) are the epoch's, each once."""
    cfg, manifest = produce_topic(
        RAW,
        150,
        partitions=2,
        train__epochs=1,
        train__global_batch_size=6,
        train__model={"name": "mlp", "kwargs": {"hidden": 16}},
        shard__block_records=7,
        checkpoint__dir="ckpt",
        checkpoint__every_steps=5,
        checkpoint__keep_last=10,
        tracking__enabled=False,
        deepspeed__enabled=engine != "ddp",
        deepspeed__zero_stage=2,
    )
    first, trained_by_two = train_ranks(2, cfg, manifest, tmp_path / "two")
    whole_epoch = Counter(i for _, _, indices in trained_by_two for i in indices)
    # 128 train messages: 64 a rank, 63 in 21 batches of 3 (one record is the tail each epoch leaves out)
    assert first["steps"] == 21 and set(whole_epoch.values()) == {1} and sum(whole_epoch.values()) == 126
    mid = ckpt.list_lineages(tmp_path / "two" / "ckpt")[0] / ("step-00000005" + (".pt" if engine == "ddp" else ""))
    before = [i for _, batch, indices in trained_by_two if batch < 5 for i in indices]
    resumed, trained_by_three = train_ranks(
        3, cfg.override({"checkpoint.resume": str(mid)}), manifest, tmp_path / "on3"
    )
    assert {epoch for epoch, _, _ in trained_by_three} == {0} and resumed["world_size"] == 3
    assert resumed["engine"] == first["engine"] == engine
    assert resumed["resumed"] == {"checkpoint": str(mid), "written_by_ranks": 2, "step": 5}
    assert first["resumed"] is None
    audit = Counter(before + [i for _, _, indices in trained_by_three for i in indices])
    assert audit == whole_epoch, f"missing or repeated: {set(whole_epoch) ^ set(audit)}"
    # 5 steps of 6 records before; the 96 left, 32 a rank, in 16 steps of 2 a rank after
    assert resumed["steps"] == 21 and resumed["test_accuracy"] is not None

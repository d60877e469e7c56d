"""Two real gloo ranks (torch.multiprocessing, no Spark) running kbit's per-rank trainer on in-memory shards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.data.loader import LoaderStats
from kbit_core.errors import DistributedError
from kbit_core.kafka.manifest import Manifest
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.metrics import SpikeDetector
from kbit_core.train.worker import run_worker, train_main
from tests.conftest import free_port
from tests.integration.dataplane_fixtures import RAW, Produce, extended, inject

WORLD_SIZE = 2
IMAGE_SHAPE = (1, 16, 16)
NUM_CLASSES = 4
SPLIT_SIZES = {"train": 512, "val": 128, "test": 128}


class MemoryShardLoader:
    """A ShardLoader stand-in: this rank's slice of an in-memory split, reshuffled per epoch, resumable.

    ``nan_at`` = (epoch, batch) poisons that batch with NaN pixels, to drive the divergence policy.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        nan_at: tuple[int, int] | None = None,
    ) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rank, self.world_size, self.seed, self.nan_at = rank, world_size, seed, nan_at
        self.epoch = self.position = 0
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return len(self.x) // self.world_size // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def close(self) -> None:
        """Nothing to release: the tensors belong to the test."""

    def __iter__(self):
        order = np.random.default_rng(self.seed + self.epoch).permutation(len(self.x))[self.rank :: self.world_size]
        for batch in range(self.position, len(self)):
            idx = torch.from_numpy(order[batch * self.batch_size : (batch + 1) * self.batch_size])
            x = self.x[idx].clone()
            if self.nan_at == (self.epoch, batch):
                x[0] = float("nan")
            self.position = batch + 1
            yield x, self.y[idx]


def make_split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of one fixed random template per class: learnable in a few steps."""
    templates = torch.rand((NUM_CLASSES, *IMAGE_SHAPE), generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    y = torch.randint(0, NUM_CLASSES, (SPLIT_SIZES[name],), generator=gen)
    x = (0.6 * templates[y] + 0.4 * torch.rand((len(y), *IMAGE_SHAPE), generator=gen)).float()
    return x, y


def memory_loaders(cfg: KbitConfig, env: DistEnv, nan_at: tuple[int, int] | None = None) -> SplitLoaders:
    per_rank = cfg.train.global_batch_size // env.world_size
    made = {}
    for split in SPLIT_SIZES:
        x, y = make_split(split)
        made[split] = MemoryShardLoader(
            x,
            y,
            per_rank,
            env.rank,
            env.world_size,
            cfg.shard.seed,
            nan_at if split == "train" and env.rank == 1 else None,
        )
    return SplitLoaders(**made)


def _rank_env(rank: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1"
    )
    torch.set_num_threads(1)


def _rank_main(
    rank: int, ports: list[int], jobs: list[tuple[dict[str, Any], str]], nan_at: tuple[int, int] | None
) -> None:
    """One rank: run each (config, run_dir) job in turn, each in a fresh process group on its own port."""
    _rank_env(rank)
    for port, (config, run_dir) in zip(ports, jobs, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        result = run_worker(
            KbitConfig.from_dict(config), run_dir, lambda c, e: memory_loaders(c, e, nan_at), IMAGE_SHAPE, NUM_CLASSES
        )
        Path(run_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _kafka_rank_main(rank: int, port: int, config: dict[str, Any], manifest_json: str, run_dir: str) -> None:
    """One rank of ``train_main``, the entry TorchDistributor runs, streaming its shard from the broker."""
    _rank_env(rank)
    os.environ["MASTER_PORT"] = str(port)
    result = train_main(KbitConfig.from_dict(config), manifest_json, run_dir)
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_kafka_ranks(cfg: KbitConfig, manifest: Manifest, run_dir: Path) -> dict[str, Any]:
    """``train_main`` on WORLD_SIZE spawned ranks streaming ``manifest``'s topic; the result every rank returned."""
    run_dir.mkdir()
    mp.spawn(
        _kafka_rank_main,
        nprocs=WORLD_SIZE,
        join=True,
        args=(free_port(), cfg.to_secret_dict(), manifest.model_dump_json(), str(run_dir)),
    )
    return rank_results(run_dir)


def train_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    base = {
        "workdir": str(tmp_path / "kbit"),
        "launch": {"num_processes": WORLD_SIZE, "timeout_s": 60},
        "shard": {"seed": 7},
        "train": {
            "data": "memory",
            "epochs": 2,
            "global_batch_size": 32,
            "seed": 3,
            "model": {"name": "mlp", "kwargs": {"hidden": 32}},
            "optim": {"name": "adam", "lr": 3e-3},
        },
        "tracking": {"enabled": False},
    }
    return KbitConfig.from_dict(deep_merge(base, sections)).to_secret_dict()


def run_ranks(jobs: list[tuple[dict[str, Any], Path]], nan_at: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Spawn both ranks once (process start and imports dominate on CPU) to run ``jobs`` in order.

    Returns each job's result, after checking that every rank returned the same one.
    """
    for _, run_dir in jobs:
        run_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(
        _rank_main,
        args=([free_port() for _ in jobs], [(c, str(d)) for c, d in jobs], nan_at),
        nprocs=WORLD_SIZE,
        join=True,
    )
    return [rank_results(run_dir) for _, run_dir in jobs]


def run_one(config: dict[str, Any], run_dir: Path, nan_at: tuple[int, int] | None = None) -> dict[str, Any]:
    return run_ranks([(config, run_dir)], nan_at)[0]


def rank_results(run_dir: Path) -> dict[str, Any]:
    """The run's result, after checking that every rank returned the same one."""
    results = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert results[0] == results[1], f"ranks returned different results in {run_dir}"
    return results[0]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Two epochs of DDP on the MLP with a constant LR: the baseline several tests compare against."""
    tmp = tmp_path_factory.mktemp("ddp")
    return run_one(train_config(tmp), tmp / "run"), tmp / "run"


@pytest.mark.slow
def test_ddp_learns_and_reports(ddp_run: tuple[dict[str, Any], Path]) -> None:
    result, run_dir = ddp_run
    assert result["engine"] == "ddp" and result["backend"] == "gloo" and result["world_size"] == WORLD_SIZE
    assert result["epochs"] == 2 and result["steps"] == 2 * 16  # 512 samples / 32 per step
    assert len(result["loss_curve"]) == result["steps"] and len(result["history"]) == 2
    assert result["loss_curve"][-1] < 0.5 * result["loss_curve"][0]
    assert result["test_accuracy"] > 0.9 and result["val_accuracy"][-1] > 0.9
    assert result["samples_per_s"] > 0 and 0 <= result["data_wait_fraction"] < 1 and result["peak_memory_mb"] > 0
    assert json.loads((run_dir / "train_result.json").read_text()) == result


@pytest.mark.slow
def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path: Path) -> None:
    """Weights, EMA and optimizer state after resuming mid-epoch equal the uninterrupted run's, bit for bit.

    The CNN's dropout makes the comparison depend on the restored RNG; the loader on the restored position.
    """
    common = {
        "train": {
            "model": {"name": "cnn", "kwargs": {}},
            "ema_decay": 0.9,
            "grad_accum_steps": 2,
            "optim": {"schedule": "cosine", "warmup_steps": 2},
        }
    }
    straight = train_config(
        tmp_path, **common, checkpoint={"dir": "ckpt", "every_steps": 3, "keep_last": 10, "async_save": True}
    )
    full = run_one(straight, tmp_path / "straight")
    # epoch 0, 6 of 16 micro-batches done, in the straight run's lineage
    mid = ckpt.list_lineages(tmp_path / "straight" / "ckpt")[0] / "step-00000003.pt"
    resumed_cfg = train_config(tmp_path, **common, checkpoint={"dir": "ckpt", "resume": str(mid), "keep_last": 10})
    resumed = run_one(resumed_cfg, tmp_path / "resumed")
    assert ckpt.read_file(mid)[ckpt.TRAIN_STATE]["batch_in_epoch"] == 6

    final_a = ckpt.read_file(ckpt.latest_checkpoint(tmp_path / "straight" / "ckpt"))
    final_b = ckpt.read_file(ckpt.latest_checkpoint(tmp_path / "resumed" / "ckpt"))
    for key in (ckpt.MODEL, ckpt.EMA):
        assert final_a[key].keys() == final_b[key].keys()
        for name, tensor in final_a[key].items():
            assert torch.equal(tensor, final_b[key][name]), f"{key}.{name} differs after resume"
    for index, param_state in final_a[ckpt.OPTIMIZER]["state"].items():
        for name, value in param_state.items():
            assert torch.equal(value, final_b[ckpt.OPTIMIZER]["state"][index][name]), f"optimizer {index}.{name}"
    assert resumed["loss_curve"] == full["loss_curve"] and resumed["test_loss"] == full["test_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_follows_ddp_loss_curve(tmp_path: Path, ddp_run: tuple[dict[str, Any], Path], stage: int) -> None:
    # One DeepSpeed engine per process: DeepSpeed keeps its process groups in module globals.
    ddp, _ = ddp_run
    ds = run_one(
        train_config(
            tmp_path, train={"epochs": 1}, deepspeed={"enabled": True, "zero_stage": stage}, checkpoint={"dir": "ckpt"}
        ),
        tmp_path / "run",
    )
    assert ds["engine"] == f"deepspeed-zero{stage}" and ds["steps"] == 16
    # Same data, seed and fp32 maths as DDP's first epoch (constant LR); only the reduction order differs.
    np.testing.assert_allclose(ds["loss_curve"], ddp["loss_curve"][:16], rtol=1e-4, atol=1e-5)
    assert ckpt.latest_checkpoint(tmp_path / "run" / "ckpt").name == "step-00000016"
    assert (ckpt.latest_checkpoint(tmp_path / "run" / "ckpt") / ckpt.SIDE_FILE).is_file()


@pytest.mark.slow
def test_deepspeed_features_train_and_resume_mid_epoch(tmp_path: Path) -> None:
    """ZeRO-2 with bf16, CPU optimizer offload, activation checkpointing, accumulation, clipping and EMA.

    Resuming from its sharded mid-epoch checkpoint (DeepSpeed's files plus kbit's JSON side file) continues
    on exactly the same loss curve; the same checkpoint with a pickled object added is refused.
    """
    sections = {
        "train": {"epochs": 1, "precision": "bf16", "grad_accum_steps": 2, "grad_clip_norm": 1.0, "ema_decay": 0.9},
        "deepspeed": {"enabled": True, "zero_stage": 2, "offload_optimizer": True, "activation_checkpointing": True},
    }
    first = run_one(
        train_config(tmp_path, **sections, checkpoint={"dir": "ckpt", "every_steps": 3}), tmp_path / "first"
    )
    mid = ckpt.list_lineages(tmp_path / "first" / "ckpt")[0] / "step-00000003"
    assert ckpt.read_side_file(mid)[ckpt.TRAIN_STATE]["batch_in_epoch"] == 6
    assert first["engine"] == "deepspeed-zero2" and first["steps"] == 8
    assert first["loss_curve"][-1] < first["loss_curve"][0] and first["test_accuracy"] > 0.5
    resumed = run_one(
        train_config(tmp_path, **sections, checkpoint={"dir": "ckpt", "resume": str(mid)}), tmp_path / "resumed"
    )
    assert resumed["loss_curve"] == first["loss_curve"] and resumed["test_loss"] == first["test_loss"]

    # DeepSpeed's files load with weights_only=True: one holding an arbitrary object is refused, not unpickled.
    model_states = mid / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(model_states, weights_only=False), "payload": Intruder()}, model_states)
    with pytest.raises(mp.ProcessRaisedException, match=r"Weights only load failed(.|\n)*Intruder"):
        run_one(
            train_config(tmp_path, **sections, checkpoint={"dir": "ckpt", "resume": str(mid)}), tmp_path / "tampered"
        )


class Intruder:
    """Stands for any class a crafted checkpoint names: unpickling it would run its module's code."""


@pytest.mark.slow
def test_nan_loss_fails_naming_epoch_and_batch(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match=r"TrainingDivergedError: loss is NaN/inf at epoch 1, batch 2"):
        run_one(train_config(tmp_path), tmp_path / "run", nan_at=(1, 2))


@pytest.mark.slow
def test_nan_loss_skipped_by_policy(tmp_path: Path) -> None:
    """The poisoned batch is dropped on both ranks and counted; bf16 autocast and clipping run alongside."""
    config = train_config(tmp_path, train={"nan_policy": "skip", "precision": "bf16", "grad_clip_norm": 1.0})
    result = run_one(config, tmp_path / "run", nan_at=(1, 2))
    assert result["skipped_batches"] == 1 and result["steps"] == 2 * 16 - 1
    assert np.isfinite(result["loss_curve"]).all() and result["test_accuracy"] > 0.9


@pytest.mark.kafka
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_skipped_corrupt_record_is_reported_in_the_result(produce_topic: Produce, tmp_path: Path, workers) -> None:
    """A corrupt message under bad_records=skip is counted, summed over ranks, with the record repeated in its place
    (with reader.workers=process, counted in each loader's worker process)."""
    # 39 records and the corrupt one make 40 messages: even splits, so the planner drops or pads none of them.
    cfg, manifest = produce_topic(
        RAW,
        39,
        partitions=2,
        reader__bad_records="skip",
        reader__workers=workers,
        shard__split_rates=[0.5, 0.5],
        launch__num_processes=WORLD_SIZE,
        tracking__enabled=False,
        train__global_batch_size=4,
        train__epochs=1,
        train__model={"name": "mlp", "kwargs": {"hidden": 8}},
    )
    inject(cfg, manifest.topic, 1, b"not an image")
    data = run_kafka_ranks(cfg, extended(manifest, 1, 1), tmp_path / "run")["data"]
    assert set(data) == {"train", "val"}
    assert sum(split["skipped_messages"] for split in data.values()) == 1, data
    assert sum(split["padded_records"] for split in data.values()) == 1, data
    assert all(split["gaps"] == split["retries"] == split["left_out_records"] == 0 for split in data.values()), data
    assert all(
        split["dropped_messages_per_epoch"] == split["padded_messages_per_epoch"] == 0 for split in data.values()
    ), data


def test_loss_spike_is_flagged_against_the_running_mean() -> None:
    detector = SpikeDetector(factor=3.0, window=4, min_history=2)
    assert [detector.observe(v) for v in (1.0, 1.0, 1.0, 2.5)] == [None, None, None, None]
    assert detector.observe(10.0) == pytest.approx(1.375)  # mean of the last 4: 1, 1, 1, 2.5
    assert detector.observe(1.0) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_requested_without_cuda_raises_distributed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    config = train_config(tmp_path, launch={"num_processes": 1, "use_gpu": True})
    with pytest.raises(DistributedError, match="launch.use_gpu=true but CUDA is not available"):
        run_worker(KbitConfig.from_dict(config), tmp_path, memory_loaders, IMAGE_SHAPE, NUM_CLASSES)


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            r"RANK=2 is outside \[0, WORLD_SIZE=2\)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            "WORLD_SIZE='two' is not an integer",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            "LOCAL_RANK=1 is inconsistent with RANK=0",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
            "MASTER_PORT=70000 is not a TCP port",
        ),
    ],
)
def test_bad_environment_raises_distributed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError, match=message):
        run_worker(KbitConfig.from_dict(train_config(tmp_path)), tmp_path, memory_loaders, IMAGE_SHAPE, NUM_CLASSES)

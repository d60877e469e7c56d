"""What only a GPU exercises: NCCL, fp16 with loss scaling, SyncBatchNorm, DeepSpeed fp16, CUDA RNG state in
checkpoints, and pinned loader batches copied without blocking. One rank, one process group for the module."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from kbit_core.config import KbitConfig
from kbit_core.data.batching import to_batch
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv, import_deepspeed, init_process_group, read_env
from kbit_core.train.engine import DDPEngine
from kbit_core.train.engine_factory import build_engine

pytestmark = pytest.mark.gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env() -> Iterator[DistEnv]:
    environ = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    env = read_env(True, environ)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():  # init_process_group reads the rendezvous from the environment
            patch.setenv(name, value)
        init_process_group(env, timeout_s=60)
        yield env
        dist.destroy_process_group()


def small_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))


def config(**train: object) -> KbitConfig:
    return KbitConfig.from_dict({"launch": {"use_gpu": True, "num_processes": 1}, "train": train})


def batch(env: DistEnv, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.rand(n, 1, 28, 28, generator=generator).to(env.device),
        torch.randint(0, 10, (n,), generator=generator).to(env.device),
    )


def test_nccl_all_reduce(env: DistEnv) -> None:
    assert env.backend == "nccl" and dist.get_backend() == "nccl"
    tensor = torch.arange(4, dtype=torch.float32, device=env.device)
    dist.all_reduce(tensor)
    assert tensor.device.type == "cuda" and tensor.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_fp16_trains_with_a_grad_scaler_that_skips_overflowing_steps(env: DistEnv) -> None:
    engine = DDPEngine(small_model(), config(precision="fp16"), env, steps_per_epoch=4, total_steps=4)
    assert engine.scaler is not None
    x, y = batch(env)
    before = [p.detach().clone() for p in engine.module.parameters()]
    logits = engine.forward(x)
    assert logits.dtype == torch.float16
    engine.backward(nn.functional.cross_entropy(logits.float(), y))
    engine.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    scale, kept = engine.scaler.get_scale(), [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine.forward(x).float().sum() * float("inf"))
    engine.step()  # the inf gradients make the scaler skip this step and halve its scale
    assert engine.scaler.get_scale() < scale
    assert all(torch.equal(a, b) for a, b in zip(kept, engine.module.parameters()))


def test_sync_batchnorm_replaces_batchnorm_on_gpu(env: DistEnv) -> None:
    engine = DDPEngine(small_model(), config(sync_batchnorm=True), env, steps_per_epoch=1, total_steps=1)
    kinds = {type(m) for m in engine.module.modules()}
    assert nn.SyncBatchNorm in kinds and nn.BatchNorm2d not in kinds
    x, y = batch(env)
    engine.backward(nn.functional.cross_entropy(engine.forward(x), y))
    engine.step()
    norm = next(m for m in engine.module.modules() if isinstance(m, nn.SyncBatchNorm))
    assert norm.num_batches_tracked.item() == 1 and torch.isfinite(norm.running_mean).all()


def test_deepspeed_fp16_step(env: DistEnv) -> None:
    deepspeed = import_deepspeed(env.device)
    assert deepspeed is not None, "deepspeed must import on a GPU machine"
    cfg = KbitConfig.from_dict(
        {
            "launch": {"use_gpu": True, "num_processes": 1},
            "train": {"precision": "fp16"},
            "deepspeed": {"enabled": True, "zero_stage": 1},
        }
    )
    engine = build_engine(small_model(), cfg, env, steps_per_epoch=2, total_steps=2, deepspeed=deepspeed)
    x, y = batch(env)
    with engine.accumulation(True):
        logits = engine.forward(x)
        assert logits.dtype == torch.float16
        loss = nn.functional.cross_entropy(logits.float(), y)
        engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_cuda_rng_state_round_trips_through_a_checkpoint(env: DistEnv, tmp_path) -> None:
    torch.cuda.manual_seed(1234)
    state = ckpt.rng_state(env.device)
    assert "cuda" in state
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    expected = torch.rand(5, device=env.device)
    torch.cuda.manual_seed(99)
    ckpt.set_rng_state(torch.load(path, weights_only=True), env.device)
    torch.testing.assert_close(torch.rand(5, device=env.device), expected, rtol=0, atol=0)


def test_loader_batches_are_pinned_and_copy_without_blocking(env: DistEnv) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (16, 1, 28, 28), dtype=np.uint8)
    batch = to_batch(pixels, np.arange(16), np.arange(16), pin_memory=True)
    x, y = batch.x, batch.y
    assert x.is_pinned() and y.is_pinned()
    on_gpu = x.to(env.device, non_blocking=True)
    torch.cuda.current_stream(env.device).synchronize()
    torch.testing.assert_close(on_gpu.cpu(), torch.from_numpy(pixels / np.float32(255)), rtol=0, atol=0)

"""What activation checkpointing saves: peak memory and step time of the DDP engine's training step, with and without
``train.activation_checkpointing``, on the same model, batch and seed.

Each configuration runs in a fresh process of its own (a one-rank gloo group), so one's peak cannot hide the
other's. On CPU the peak is the process's peak resident set size (VmHWM) above its resident set just before
the first step, with glibc returning each freed tensor at once; on CUDA it is ``torch.cuda.max_memory_allocated``
above the allocation before it.

    python -m kbit_core.bench.training.activation_memory [--dim 128 --depth 6 --batch 256] [-o FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kbit_core.config import KbitConfig
from kbit_core.data.allocator import unmap_freed_blocks
from kbit_core.train.distributed import DistEnv
from kbit_core.train.engine import DDPEngine
from kbit_core.train.models import build_model

IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
MEASURED_STEPS = 3


def _resident_mb() -> float:
    """This process's resident set size now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a process spawned from a large one (a test
    # session several GB in) would report its parent's peak; VmHWM belongs to this process image alone.
    with open("/proc/self/status") as status:
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return hwm_kib / 1024


def _current_mb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else _resident_mb()


def measure_step(config: dict[str, Any], batch: int, device_name: str, store: str) -> dict[str, float]:
    """In this (fresh) process: MEASURED_STEPS steps of the DDP engine; the peak memory above the level before the
    first, and the mean step time."""
    cfg = KbitConfig.from_dict(config)
    device = torch.device(device_name)
    if device.type == "cpu":
        # Each freed tensor leaves the resident set at once, so the peak follows the tensors alive together, not what
        # the heap kept of earlier ones. Without it the two peaks varied by ±5 MB from run to run and crossed at dim
        # 64, depth 4, batch 256; with it, ±0.1 MB.
        unmap_freed_blocks(64 * 1024)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.train.model, IMAGE_SHAPE, NUM_CLASSES)
        env = DistEnv(0, 1, 0, "127.0.0.1", 0, device)
        engine = DDPEngine(model, cfg, env, steps_per_epoch=10, total_steps=10)
        x = torch.rand(batch, *IMAGE_SHAPE, device=device)
        y = torch.randint(0, NUM_CLASSES, (batch,), device=device)
        # From before the first step: the allocator keeps what a step freed, so a later step's peak can reuse it
        # without the process growing (the optimizer's state, allocated at the first step, is the same in both).
        before = _current_mb(device)
        started = time.perf_counter()
        for _ in range(MEASURED_STEPS):
            _step(engine, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = (time.perf_counter() - started) / MEASURED_STEPS
        return {"peak_above_start_mb": _peak_mb(device) - before, "step_s": step_s}
    finally:
        torch.distributed.destroy_process_group()


def _step(engine: DDPEngine, x: torch.Tensor, y: torch.Tensor) -> None:
    engine.backward(F.cross_entropy(engine.forward(x), y))
    engine.step()


def _in_fresh_process(config: dict[str, Any], batch: int, device: str) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch, context.Pool(1) as pool:
        return pool.apply(measure_step, (config, batch, device, str(Path(scratch) / "store")))


def run(dim: int, depth: int, batch: int, device: str = "cpu") -> dict[str, Any]:
    """Both configurations of the ViT (``dim`` wide, ``depth`` blocks) at ``batch`` images of 28×28; the ratios
    are checkpointed / plain, measured in the same run."""
    model = {"name": "vit", "kwargs": {"dim": dim, "depth": depth, "heads": 4}}
    measured = {}
    for name, checkpointing in (("plain", False), ("checkpointed", True)):
        config = {
            "train": {"model": model, "activation_checkpointing": checkpointing, "deterministic": False},
            "launch": {"num_processes": 1},
        }
        measured[name] = _in_fresh_process(config, batch, device)
    plain, checkpointed = measured["plain"], measured["checkpointed"]
    return {
        "model": model,
        "batch": batch,
        "device": device,
        "measured_steps": MEASURED_STEPS,
        **measured,
        "memory_ratio": checkpointed["peak_above_start_mb"] / plain["peak_above_start_mb"],
        "memory_saved_mb": plain["peak_above_start_mb"] - checkpointed["peak_above_start_mb"],
        "step_time_ratio": checkpointed["step_s"] / plain["step_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-o", "--output", type=Path, default=Path(".kbit/reports/activation_memory.json"))
    args = parser.parse_args()
    report = run(args.dim, args.depth, args.batch, args.device)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

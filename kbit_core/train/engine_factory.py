"""Picks the engine for a run: DDP, DeepSpeed ZeRO, DeepSpeed's pipeline engine, or torch tensor parallelism."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from kbit_core.config import KbitConfig
from kbit_core.train.distributed import DistEnv
from kbit_core.train.engine import DDPEngine, DeepSpeedEngine, Engine
from kbit_core.train.pipeline import PipelineEngine
from kbit_core.train.tensor_parallel import TensorParallelEngine


def build_engine(
    model: nn.Module,
    cfg: KbitConfig,
    env: DistEnv,
    steps_per_epoch: int,
    total_steps: int,
    deepspeed: ModuleType | None,
) -> Engine:
    """Tensor parallelism when ``train.tensor_parallel.size`` > 1; DeepSpeed's pipeline engine when ``train.pipeline.stages`` > 1, DeepSpeed ZeRO when ``deepspeed`` is given
    (DeepSpeed enabled and importable), else DDP."""
    if cfg.train.tensor_parallel.size > 1:
        return TensorParallelEngine(model, cfg, env, steps_per_epoch, total_steps)
    if deepspeed is None:
        return DDPEngine(model, cfg, env, steps_per_epoch, total_steps)
    engine_type = PipelineEngine if cfg.train.pipeline.stages > 1 else DeepSpeedEngine
    return engine_type(deepspeed, model, cfg, env, steps_per_epoch, total_steps)

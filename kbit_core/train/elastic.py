"""Which batch-mode checkpoints resume at another world size: DDP and DeepSpeed ZeRO ones (the loaders re-plan the
epoch's rest; ZeRO's partitions go through a universal checkpoint), not tensor-parallel or pipeline ones."""

from __future__ import annotations

from pathlib import Path

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError


def world_size_pinned_by(cfg: KbitConfig) -> str | None:
    """Why a batch-mode checkpoint of ``cfg`` resumes only at the world size that wrote it; None when any world size
    may continue it (DDP re-plans the epoch's rest; DeepSpeed ZeRO also goes through its universal checkpoint)."""
    if cfg.train.mode != "batch":
        return None
    if cfg.train.tensor_parallel.size > 1:
        return (
            "under tensor parallelism a tensor-parallel group's ranks share one reader, and kbit re-plans an "
            "epoch's rest only over plain data-parallel ranks"
        )
    if cfg.train.pipeline.stages > 1:
        return (
            "DeepSpeed's pipeline engine stores its layers per stage and only its first stage reads, and kbit "
            "re-plans an epoch's rest (and converts to a universal checkpoint) only for plain ZeRO data parallelism"
        )
    return None


def check_elastic(cfg: KbitConfig, path: Path, written_by: int, world_size: int) -> None:
    """Refuse resuming ``path``, written by ``written_by`` ranks, at ``world_size`` where ``cfg`` pins it.

    Raises:
        ConfigError: one line naming both world sizes and why.
    """
    reason = world_size_pinned_by(cfg)
    if reason is not None:
        raise ConfigError(
            f"checkpoint {path} was written by {written_by} ranks and this run has {world_size}: {reason}; "
            f"resume it with launch.num_processes={written_by}"
        )

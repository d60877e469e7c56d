"""Launch the ranks and, when a worker fails, launch them again from the latest checkpoint: batch and continuous
training share this one restart loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbit_core.brokers.local import died_here
from kbit_core.config import KbitConfig
from kbit_core.errors import BrokerError
from kbit_core.launch import launch
from kbit_core.launch.distributor import WorkerFailedError
from kbit_core.train import checkpoint as ckpt

log = logging.getLogger(__name__)

# A worker that raised one of these fails the same way again: restarting would only repeat it.
NOT_RESTARTABLE = (
    "ConfigError",
    "ManifestMismatchError",
    "TopicError",
    "CorruptRecordError",
    "ModuleNotFoundError",
    "ImportError",
    "TrainingDivergedError",
    "PermissionError",
    "FileNotFoundError",
    "NotADirectoryError",
    "IsADirectoryError",
    "FileExistsError",
    "PreflightError",
)


def train_with_restarts(
    cfg: KbitConfig,
    train_main: Callable[..., dict[str, Any]],
    manifest_json: str,
    before_restart: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """Run ``train_main`` on every rank, restarting up to ``checkpoint.max_restarts`` times; rank 0's result.

    ``before_restart`` runs on the driver before each launch after the first (e.g. to produce again a topic the
    broker lost).
    """
    attempt_cfg, restarts = cfg, 0
    while True:
        if restarts:
            before_restart()
        attempt_started, lineages_before = time.time(), set(_lineages(cfg))
        try:
            result = launch(train_main, attempt_cfg, manifest_json, str(cfg.run_dir))
            return {**result, "restarts": restarts}
        except WorkerFailedError as exc:
            died = died_here(cfg.kafka) if cfg.kafka.uses_embedded else None
            if died is not None:  # a restart would fail the same way: nothing serves the topic any more
                raise BrokerError(f"training failed on {exc.rank} ({exc.exception_type}): {died}") from exc
            if restarts >= cfg.checkpoint.max_restarts or _not_restartable(exc):
                raise
            restarts += 1
            attempt_cfg = _restart_config(cfg, attempt_cfg, lineages_before, attempt_started)
            # The next attempt clears <run_dir>/errors, so the failure is logged in full here.
            log.warning(
                "training failed on %s (host %s) with %s; restart %d of %d from %s\n%s",
                exc.rank,
                exc.host,
                exc.exception_type,
                restarts,
                cfg.checkpoint.max_restarts,
                _restart_point(attempt_cfg),
                exc.details or exc,
            )


def _not_restartable(exc: WorkerFailedError) -> bool:
    return exc.exception_type.rsplit(".", 1)[-1] in NOT_RESTARTABLE


def _checkpoint_dir(cfg: KbitConfig) -> Path | None:
    # The worker resolves a relative checkpoint.dir against the run directory it is given (cfg.run_dir).
    return cfg.run_dir / cfg.checkpoint.dir if cfg.checkpoint.dir is not None else None


def _lineages(cfg: KbitConfig) -> list[Path]:
    directory = _checkpoint_dir(cfg)
    return ckpt.list_lineages(directory) if directory is not None else []


def _restart_config(cfg: KbitConfig, failed: KbitConfig, before: set[Path], started: float) -> KbitConfig:
    """The config of the next attempt: pinned to the lineage the failed attempt wrote (never another run's), or,
    when it wrote no checkpoint, the failed attempt's own starting point again."""
    written = [
        lineage
        for lineage in _lineages(cfg)
        if any(c.stat().st_mtime >= started for c in ckpt.list_checkpoints(lineage))
        or (lineage not in before and ckpt.list_checkpoints(lineage))
    ]
    return cfg.resuming(written[-1]) if written else failed


def _restart_point(cfg: KbitConfig) -> str:
    directory = _checkpoint_dir(cfg)
    if directory is None:
        return "scratch (checkpoint.dir is unset)"
    found = ckpt.resolve_resume(cfg, directory, cfg.run_dir)
    return str(found) if found is not None else f"scratch (no checkpoint in {directory} to resume)"

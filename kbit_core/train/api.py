"""The driver side of training: make sure the data is in Kafka, launch the ranks, restart from checkpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.preflight import check_training
from kbit_core.train import checkpoint as ckpt
from kbit_core.kafka.broker import embedded_broker
from kbit_core.launch import launch
from kbit_core.launch.distributor import WorkerFailedError
from kbit_core.tracking import Tracker, make_tracker

log = logging.getLogger(__name__)

# A worker that raised one of these fails the same way again: restarting would only repeat it.
NOT_RESTARTABLE = ("ConfigError", "ManifestMismatchError", "TopicError", "CorruptRecordError", "ModuleNotFoundError",
                   "ImportError", "TrainingDivergedError", "PermissionError", "FileNotFoundError",
                   "NotADirectoryError", "IsADirectoryError", "FileExistsError", "PreflightError")


def train(cfg: KbitConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train ``cfg`` end to end and return the workers' result (identical on every rank) plus driver facts.

    Steps: start the embedded broker when the config uses it and nothing listens there; produce the
    dataset's topic or reuse it (``produce_dataset``); run ``train_main`` on every rank through the engine
    ``launch.engine`` names (TorchDistributor, Ray Train or plain torchrun); when a worker fails, restart from the latest checkpoint up to
    ``checkpoint.max_restarts`` times; track params, per-epoch/per-step metrics and the final model
    in MLflow (when ``tracking.enabled``). ``train.mode: continuous`` trains on the live stream instead
    (:func:`kbit_core.stream.driver.train_continuous`: no produce step, the same restarts and tracking).

    Raises:
        DistributedError: a worker failed and no restart was left (or the failure is not one a restart fixes).
    """
    from kbit_core.kafka.manifest import manifest_path
    from kbit_core.kafka.producer import produce_dataset
    from kbit_core.train.worker import train_main

    started = time.perf_counter()
    for warning in check_training(cfg).warnings:
        log.warning("%s", warning)
    tracker = make_tracker(cfg)
    with embedded_broker(cfg), tracker.run(cfg, name=f"train-{cfg.profile}", kind="train") as run_id:
        if cfg.train.mode == "continuous":
            from kbit_core.stream.driver import train_continuous

            result = train_continuous(cfg, run_id, progress=progress)
        else:
            manifest = produce_dataset(cfg, progress=progress)
            result = _train_with_restarts(cfg, train_main, manifest.model_dump_json())
            result.update(topic=manifest.topic, manifest_path=str(manifest_path(cfg.workdir, manifest.topic)),
                          mlflow_run_id=run_id)
        result["wall_seconds"] = time.perf_counter() - started
        _track(tracker, run_id, result)
    return result


def _track(tracker: Tracker, run_id: str | None, result: dict[str, Any]) -> None:
    """Log the result to MLflow; a tracking failure is reported in the result and the log, never loses the result."""
    checkpoint = result.get("checkpoint")
    try:
        tracker.log_training(run_id, result, model_path=Path(checkpoint) if checkpoint else None)
    except Exception as exc:
        log.error("training finished but MLflow logging of run %s failed: %s", run_id, exc)
        result["tracking_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"


def _train_with_restarts(cfg: KbitConfig, train_main: Callable[..., dict[str, Any]], manifest_json: str,
                         before_attempt: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """``before_attempt`` runs on the driver before each launch (e.g. to produce again a topic the broker lost)."""
    attempt_cfg, restarts = cfg, 0
    while True:
        before_attempt()
        attempt_started, lineages_before = time.time(), set(_lineages(cfg))
        try:
            result = launch(train_main, attempt_cfg, manifest_json, str(cfg.run_dir))
            return {**result, "restarts": restarts}
        except WorkerFailedError as exc:
            if restarts >= cfg.checkpoint.max_restarts or _not_restartable(exc):
                raise
            restarts += 1
            attempt_cfg = _restart_config(cfg, attempt_cfg, lineages_before, attempt_started)
            # The next attempt clears <run_dir>/errors, so the failure is logged in full here.
            log.warning("training failed on %s (host %s) with %s; restart %d of %d from %s\n%s", exc.rank, exc.host,
                        exc.exception_type, restarts, cfg.checkpoint.max_restarts, _restart_point(attempt_cfg), exc)


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
    written = [lineage for lineage in _lineages(cfg)
               if any(c.stat().st_mtime >= started for c in ckpt.list_checkpoints(lineage))
               or (lineage not in before and ckpt.list_checkpoints(lineage))]
    return cfg.override({"checkpoint.resume": str(written[-1])}) if written else failed


def _restart_point(cfg: KbitConfig) -> str:
    directory = _checkpoint_dir(cfg)
    if directory is None:
        return "scratch (checkpoint.dir is unset)"
    found = ckpt.resolve_resume(cfg, directory, cfg.run_dir)
    return str(found) if found is not None else f"scratch (no checkpoint in {directory} to resume)"

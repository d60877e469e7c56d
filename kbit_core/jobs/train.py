"""The train job: make sure the data is in Kafka, launch the ranks (restarting from checkpoints), track the run."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from kbit_core.brokers.local import embedded_broker
from kbit_core.config import KbitConfig
from kbit_core.data.dataset_reader import dataset_manifest
from kbit_core.datasets import open_source
from kbit_core.jobs.continuous import train_continuous
from kbit_core.jobs.preflight import check_training
from kbit_core.jobs.restarts import train_with_restarts
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.produce import produce_dataset
from kbit_core.topic_dataset import snapshot_dataset
from kbit_core.tracking import Tracker, make_tracker, training_run_name
from kbit_core.train.direct_worker import train_direct_main
from kbit_core.train.worker import train_main

log = logging.getLogger(__name__)


def train(cfg: KbitConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train ``cfg`` end to end and return the workers' result (identical on every rank) plus driver facts.

    Steps: start the embedded broker when the config uses it and nothing listens there; produce the
    dataset's topic or reuse it (``produce_dataset``), or with ``train.data: direct`` neither (each rank reads the
    dataset itself: ``train_direct_main``); run ``train_main`` on every rank through the engine
    ``launch.engine`` names (TorchDistributor, Ray Train or plain torchrun); when a worker fails, restart from the latest checkpoint up to
    ``checkpoint.max_restarts`` times; track params, per-epoch/per-step metrics and the final model
    in MLflow (when ``tracking.enabled``). ``train.mode: continuous`` trains on the live stream instead
    (:func:`kbit_core.jobs.continuous.train_continuous`: no produce step, the same restarts and tracking).

    Raises:
        DistributedError: a worker failed and no restart was left (or the failure is not one a restart fixes).
    """
    started = time.perf_counter()
    for warning in check_training(cfg).warnings:
        log.warning("%s", warning)
    tracker = make_tracker(cfg)
    direct = cfg.train.data == "direct"
    broker = contextlib.nullcontext() if direct else embedded_broker(cfg)  # direct: no Kafka at all
    with broker, tracker.run(cfg, name=training_run_name(cfg), kind="train") as run_id:
        if cfg.train.mode == "continuous":
            result = train_continuous(cfg, run_id, progress=progress)
        elif direct:
            dataset = dataset_manifest(cfg, open_source(cfg.dataset, exact=True))
            result = train_with_restarts(cfg, train_direct_main, dataset.model_dump_json())
            result.update(dataset=dataset.topic, mlflow_run_id=run_id)
        else:
            manifest = dataset_manifest_of(cfg, progress)
            result = train_with_restarts(cfg, train_main, manifest.model_dump_json())
            result.update(
                topic=manifest.topic,
                manifest_path=str(manifest_path(cfg.workdir, manifest.topic)),
                mlflow_run_id=run_id,
            )
        result["wall_seconds"] = time.perf_counter() - started
        _track(tracker, run_id, result)
    return result


def dataset_manifest_of(cfg: KbitConfig, progress: bool) -> Manifest:
    """The manifest a run reads: the snapshot of a user's topic (source.topic), else kbit's topic of the dataset,
    produced or reused (check_training checked either)."""
    if cfg.source.topic is not None:
        return snapshot_dataset(cfg)
    return produce_dataset(cfg, progress=progress, checked=True)


def _track(tracker: Tracker, run_id: str | None, result: dict[str, Any]) -> None:
    """Log the result to MLflow; a tracking failure is reported in the result and the log, never loses the result."""
    # The best checkpoint under checkpoint.keep_best, else the last one, is the model logged.
    checkpoint = (result.get("best") or {}).get("checkpoint") or result.get("checkpoint")
    try:
        tracker.log_training(run_id, result, model_path=Path(checkpoint) if checkpoint else None)
    except Exception as exc:
        log.error("training finished but MLflow logging of run %s failed: %s", run_id, exc)
        result["tracking_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"

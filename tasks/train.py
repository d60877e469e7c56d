"""Train once through Spark's TorchDistributor (DDP or DeepSpeed), then record the run in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from kbit_core.config import KbitConfig
from kbit_core.tracking import log_training_run
from kbit_core.train.api import train
from tasks.policy import BACKOFF_S, is_transient, show_progress


def final_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Every number of a training result, per-epoch lists reduced to their last (final-epoch) value."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            value = value[-1]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


@task(name="train", retries=1, retry_delay_seconds=BACKOFF_S[1], retry_condition_fn=is_transient,
      timeout_seconds=12 * 3600)
def train_model(cfg: KbitConfig) -> dict[str, Any]:
    """Run one distributed training; the result is the workers' JSON document (history, metrics, checkpoint)."""
    return train(cfg, progress=show_progress())


@task(name="log-training-run", retries=2, retry_delay_seconds=BACKOFF_S[:2], retry_condition_fn=is_transient,
      timeout_seconds=600)
def log_training(cfg: KbitConfig, result: dict[str, Any]) -> dict[str, Any]:
    """Record the training in MLflow (metrics per epoch, final metrics, the model); return the run id and metrics."""
    checkpoint = result.get("checkpoint")
    run_id = log_training_run(cfg, result, Path(checkpoint) if checkpoint else None)
    metrics = final_metrics(result)
    get_run_logger().info("training run %s: %s", run_id, {k: round(v, 4) for k, v in metrics.items()})
    return {"mlflow_run_id": run_id, "topic": result.get("topic"), "checkpoint": checkpoint, "metrics": metrics}

"""Train once through launch.engine (Spark's TorchDistributor or Ray Train; DDP or DeepSpeed); kbit_core records the run
in MLflow."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from kbit_core.config import KbitConfig
from kbit_core.jobs.train import train
from kbit_core.tracking import final_metrics
from tasks.policy import BACKOFF_S, is_transient, show_progress


@task(
    name="train",
    retries=1,
    retry_delay_seconds=BACKOFF_S[1],
    retry_condition_fn=is_transient,
    timeout_seconds=12 * 3600,
)
def train_model(cfg: KbitConfig) -> dict[str, Any]:
    """Run one distributed training, tracked as one MLflow run (params, metrics per epoch, final metrics, model).

    Returns the run id, topic, checkpoint and final metrics (per-epoch lists reduced to their last value), plus
    ``tracking_error`` when the training finished but MLflow logging failed.
    """
    result = train(cfg, progress=show_progress())
    metrics = final_metrics(result)
    logger = get_run_logger()
    logger.info("training run %s: %s", result["mlflow_run_id"], {k: round(v, 4) for k, v in metrics.items()})
    summary = {
        "mlflow_run_id": result["mlflow_run_id"],
        "topic": result["topic"],
        "checkpoint": result.get("checkpoint"),
        "metrics": metrics,
    }
    if "tracking_error" in result:
        logger.warning("training finished but was not fully recorded in MLflow: %s", result["tracking_error"])
        summary["tracking_error"] = result["tracking_error"]
    return summary

"""Flow `train`: produce the training topic if needed, then train with DDP or DeepSpeed, tracked in MLflow."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.config import load_run_config
from tasks.produce import ensure_dataset_topics
from tasks.report import publish_training_summary
from tasks.tracking import mlflow_run_url
from tasks.train import train_model


@flow(name="train", log_prints=True)
def train(profile: str = "train", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train once on the profile's dataset variant.

    Steps:
      1. Load and validate the profile with the overrides.
      2. Ensure the topic of ``produce.variant`` exists (reused when its manifest matches).
      3. Train through Spark's TorchDistributor (DDP, or DeepSpeed ZeRO when enabled), recorded as one MLflow
         run: parameters, per-epoch and final metrics, the model.
      4. Publish the final metrics with a link to the MLflow run as a markdown artifact.
    """
    cfg = load_run_config(profile, overrides)
    ensure_dataset_topics(cfg, [cfg.produce.variant])
    summary = train_model(cfg)
    publish_training_summary(cfg.profile, summary, mlflow_run_url(cfg, summary["mlflow_run_id"]))
    return summary


if __name__ == "__main__":
    train(profile="train")

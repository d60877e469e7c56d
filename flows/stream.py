"""Flows `produce_stream` (the live producer) and `train_stream` (continuous training on what it appends)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.config import load_run_config
from tasks.stream import produce_stream_task, train_stream_task


@flow(name="produce_stream", log_prints=True)
def produce_stream(profile: str = "train-stream", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Append the profile's stream at ``stream.rate`` records/s (``overrides={"stream": {"rate": 500}}``).

    Steps:
      1. Load and validate the profile with the overrides.
      2. Run the live producer: it continues the sequence from its manifest, refills a broker that lost the
         topic, and stops after ``stream.duration_s`` / ``stream.records`` (or on cancellation).
    """
    return produce_stream_task(load_run_config(profile, overrides))


@flow(name="train_stream", log_prints=True)
def train_stream(profile: str = "train-stream", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train continuously on the profile's stream (run `produce_stream` alongside), one MLflow run.

    Steps:
      1. Load and validate the profile with the overrides.
      2. Train until a stop condition (duration, records, stop file, idle, cancellation) with a final checkpoint;
         lag, freshness and throughput as step series in MLflow and as this flow run's artifact.
    """
    return train_stream_task(load_run_config(profile, overrides))


if __name__ == "__main__":
    produce_stream(profile="train-stream")

"""The live stream's tasks: run the live producer, and train continuously with the lag/freshness artifact."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from kbit_core.config import KbitConfig
from kbit_core.jobs.train import train
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.report import summary_markdown
from kbit_core.tracking import final_metrics


@task(name="produce-stream", retries=0, timeout_seconds=7 * 24 * 3600)
def produce_stream_task(cfg: KbitConfig) -> dict[str, Any]:
    """Append at ``stream.rate`` until ``stream.duration_s`` / ``stream.records``; what this run appended. Not
    retried: a restart continues the sequence from the manifest anyway, so a new run is the retry."""
    run = LiveProducer(cfg).run()
    get_run_logger().info(
        "stream %s: %d records appended (%.0f/s of %.0f/s), next index %d, %d refilled after broker loss",
        run.topic,
        run.produced,
        run.achieved_rate,
        run.target_rate,
        run.next_index,
        run.refilled,
    )
    return {**asdict(run), "achieved_rate": run.achieved_rate}


@task(name="train-stream", retries=0, timeout_seconds=7 * 24 * 3600)
def train_stream_task(cfg: KbitConfig) -> dict[str, Any]:
    """Train on the live stream until it stops; publish lag, freshness and throughput as a markdown artifact.
    A cancellation reaching the driver drops the stop file, so the ranks end with a final checkpoint."""
    result = train(cfg, progress=False)
    create_markdown_artifact(
        markdown=summary_markdown(result),
        key="kbit-stream-training",
        description=f"continuous training on {result['topic']}",
    )
    for warning in result.get("lag_warnings", []):
        get_run_logger().warning("%s", warning)
    return {
        "mlflow_run_id": result["mlflow_run_id"],
        "topic": result["topic"],
        "checkpoint": result["checkpoint"],
        "stop_reason": result["stop_reason"],
        "freshness_s": result["freshness_s"],
        "lag_records": result["lag_records"],
        "metrics": final_metrics(result),
    }

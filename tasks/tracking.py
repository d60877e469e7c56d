"""MLflow lookups the flows need: where a run is shown, and the previous finished benchmark of a profile.

kbit_core.tracking writes runs; these read them back for orchestration decisions.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from kbit_core.bench.report import STATS_JSON
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from tasks.policy import BACKOFF_S, is_transient

BENCHMARK_ARTIFACT_DIR = "benchmark"


def _client(cfg: KbitConfig) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=cfg.tracking_uri())


@task(name="mlflow-run-url", retries=2, retry_delay_seconds=BACKOFF_S[:2], retry_condition_fn=is_transient,
      timeout_seconds=120)
def mlflow_run_url(cfg: KbitConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI; None when not tracked or the store has no UI (sqlite)."""
    uri = cfg.tracking_uri()
    if run_id is None or not uri.startswith(("http://", "https://")):
        return None
    experiment_id = _client(cfg).get_run(run_id).info.experiment_id
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


@task(name="find-previous-run", retries=2, retry_delay_seconds=BACKOFF_S[:2], retry_condition_fn=is_transient,
      timeout_seconds=300)
def previous_benchmark(cfg: KbitConfig, current_run_id: str) -> dict[str, Any] | None:
    """The newest finished benchmark run of this profile other than ``current_run_id``, with its stats document.

    None when there is none yet (the first night), so the first run sets the baseline.
    """
    if not cfg.tracking.enabled:
        raise ConfigError("comparing with the previous run needs tracking.enabled: the runs are found in MLflow")
    client = _client(cfg)
    experiment = client.get_experiment_by_name(cfg.experiment_name())
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=(f"tags.`kbit.kind` = 'benchmark' and tags.`kbit.profile` = '{cfg.profile}' "
                       "and attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=5,
    )
    previous = next((r for r in runs if r.info.run_id != current_run_id), None)
    if previous is None:
        get_run_logger().info("no earlier finished %r benchmark in experiment %s: this run is the baseline",
                              cfg.profile, experiment.name)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(previous.info.run_id, f"{BENCHMARK_ARTIFACT_DIR}/{STATS_JSON}", tmp)
        stats = json.loads(Path(local).read_text())
    return {"run_id": previous.info.run_id, "stats": stats}

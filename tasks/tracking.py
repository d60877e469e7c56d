"""MLflow lookups and tags the flows need: where a run is shown, its overrides, and its comparable baseline.

kbit_core.tracking writes runs; these read them back for orchestration decisions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from kbit_core import tracking
from kbit_core.bench.loading.report import STATS_JSON, load_stats
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.stats.identity import stats_identity
from tasks.policy import BACKOFF_S, is_transient


@task(
    name="mlflow-run-url",
    retries=2,
    retry_delay_seconds=BACKOFF_S[:2],
    retry_condition_fn=is_transient,
    timeout_seconds=120,
)
def mlflow_run_url(cfg: KbitConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI; None when not tracked or the store has no UI (sqlite)."""
    return tracking.run_url(cfg, run_id)


@task(
    name="record-overrides",
    retries=2,
    retry_delay_seconds=BACKOFF_S[:2],
    retry_condition_fn=is_transient,
    timeout_seconds=120,
)
def record_overrides(cfg: KbitConfig, run_id: str | None, overrides: dict[str, Any] | None) -> dict[str, str]:
    """Tag the run with the overrides that change what it measures: a run with any never becomes a baseline."""
    recorded = tracking.record_overrides(cfg, run_id, overrides)
    if recorded:
        get_run_logger().info("run %s has measurement overrides %s: it will not be a baseline", run_id, recorded)
    return recorded


@task(
    name="find-previous-run",
    retries=2,
    retry_delay_seconds=BACKOFF_S[:2],
    retry_condition_fn=is_transient,
    timeout_seconds=300,
)
def previous_benchmark(cfg: KbitConfig, current_run_id: str, current_stats_json: str) -> dict[str, Any] | None:
    """The newest finished, override-free benchmark run of this profile with the current run's identity (read from
    ``current_stats_json``), with its stats document; the runs passed over are logged with the reason.

    None when there is none yet, so the first run of an identity sets the baseline.
    """
    if not cfg.tracking.enabled:
        raise ConfigError("comparing with the previous run needs tracking.enabled: the runs are found in MLflow")
    identity = stats_identity(load_stats(Path(current_stats_json)), "current")
    previous, passed_over = tracking.previous_benchmark(cfg, current_run_id, identity, STATS_JSON)
    log = get_run_logger()
    for reason in passed_over:
        log.info("not a comparable baseline: %s", reason)
    if previous is None:
        log.info(
            "no comparable finished %r benchmark in experiment %s: this run is the baseline",
            cfg.profile,
            cfg.experiment_name(),
        )
    return previous

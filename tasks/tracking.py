"""MLflow lookups the flows need: where a run is shown, and the previous finished benchmark of a profile.

kbit_core.tracking writes runs; these read them back for orchestration decisions.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from kbit_core import tracking
from kbit_core.bench.report import STATS_JSON
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from tasks.policy import BACKOFF_S, is_transient


@task(name="mlflow-run-url", retries=2, retry_delay_seconds=BACKOFF_S[:2], retry_condition_fn=is_transient,
      timeout_seconds=120)
def mlflow_run_url(cfg: KbitConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI; None when not tracked or the store has no UI (sqlite)."""
    return tracking.run_url(cfg, run_id)


@task(name="find-previous-run", retries=2, retry_delay_seconds=BACKOFF_S[:2], retry_condition_fn=is_transient,
      timeout_seconds=300)
def previous_benchmark(cfg: KbitConfig, current_run_id: str) -> dict[str, Any] | None:
    """The newest finished benchmark run of this profile other than ``current_run_id``, with its stats document.

    None when there is none yet (the first night), so the first run sets the baseline.
    """
    if not cfg.tracking.enabled:
        raise ConfigError("comparing with the previous run needs tracking.enabled: the runs are found in MLflow")
    previous = tracking.previous_benchmark(cfg, current_run_id, STATS_JSON)
    if previous is None:
        get_run_logger().info("no earlier finished %r benchmark in experiment %s: this run is the baseline",
                              cfg.profile, cfg.experiment_name())
    return previous

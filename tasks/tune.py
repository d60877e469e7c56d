"""Run a whole sweep on Ray Tune (ASHA) in one task; kbit_core records every trial in MLflow under one parent run."""

from __future__ import annotations

from typing import Any, Literal

from prefect import get_run_logger, task

from kbit_core.config import KbitConfig
from kbit_core.jobs.sweep import tune_sweep
from kbit_core.trials import DEFAULT_SPACE


@task(name="ray-tune-sweep", timeout_seconds=24 * 3600)
def tune_trials(
    cfg: KbitConfig,
    space: dict[str, list[Any]] | None,
    num_trials: int | None,
    metric: str,
    mode: Literal["max", "min"],
    seed: int,
) -> dict[str, Any]:
    """The sweep's trials and best trial, as the Prefect backend returns them (plus the parent MLflow run id);
    ``space`` None: the standard space."""
    out = tune_sweep(cfg, space or DEFAULT_SPACE, num_trials, metric, mode, seed)
    stopped = [t["trial"] for t in out["trials"] if t["epochs"] < cfg.train.epochs]
    get_run_logger().info(
        "ray-tune sweep %s: best trial %s; ASHA stopped trials %s early",
        out["mlflow_run_id"],
        out["best"]["trial"],
        stopped,
    )
    return out

"""Flow `sweep`: hyperparameter search over training parameters, each trial tracked in MLflow, best by a metric."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from tasks.config import load_run_config
from tasks.produce import ensure_dataset_topics
from tasks.report import publish_sweep_table
from tasks.sweep import choose_best_trial, sweep_trials
from tasks.train import train_model
from tasks.tune import tune_trials


@flow(name="sweep", log_prints=True)
def sweep(
    profile: str = "train",
    overrides: dict[str, Any] | None = None,
    space: dict[str, list[Any]] | None = None,
    num_trials: int | None = None,
    metric: str = "val_accuracy",
    mode: Literal["max", "min"] = "max",
    seed: int = 0,
) -> dict[str, Any]:
    """Train one model per point of a search space and pick the best by ``metric``.

    Steps:
      1. Expand ``space`` (dotted config keys -> values; a grid, or ``num_trials`` sampled from it).
      2. Load and validate every trial's config before anything runs.
      3. Ensure the first trial's topic once (a trial whose point changes data settings produces its own).
      4. Train each trial in turn (each uses every Spark slot); each trial is its own MLflow run.
      5. Choose the best trial by ``metric`` (``mode`` max or min) and publish the trial table.

    With ``sweep.backend=ray-tune`` the same points run as Ray Tune trials instead, ASHA stopping weak ones
    after ``sweep.grace_epochs``, each trial a child of one MLflow parent run (:mod:`kbit_core.jobs.sweep`).
    """
    base = load_run_config(profile, overrides)
    if base.sweep.backend == "ray-tune":
        out = tune_trials(base, space, num_trials, metric, mode, seed)
        publish_sweep_table(out["trials"], out["best"], metric)
        return out
    trials = sweep_trials(base, space, num_trials, seed)
    first = trials[0][1]
    ensure_dataset_topics(first, [first.produce.variant])
    results = [{"trial": i, "params": trial, **train_model(cfg)} for i, (trial, cfg) in enumerate(trials)]
    best = choose_best_trial(results, metric, mode)
    publish_sweep_table(results, best, metric)
    return {"best": best, "trials": results}


if __name__ == "__main__":
    sweep(profile="train")

"""Flow `sweep`: hyperparameter search over training parameters, each trial tracked in MLflow, best by a metric."""

from __future__ import annotations

import itertools
import random
from typing import Any, Literal

from prefect import flow

from kbit_core.config import deep_merge
from kbit_core.errors import ConfigError
from tasks.config import load_run_config
from tasks.produce import ensure_dataset_topics
from tasks.train import train_model
from tasks.report import publish_sweep_table

DEFAULT_SPACE: dict[str, list[Any]] = {
    "train.optim.lr": [1e-3, 3e-3],
    "train.global_batch_size": [32, 64],
}


def expand_space(space: dict[str, list[Any]], num_trials: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The grid of ``space`` (dotted key -> candidate values) as flat trials; ``num_trials`` samples it without
    replacement, seeded, so a sweep is reproducible."""
    if not space or any(not values for values in space.values()):
        raise ConfigError(f"sweep space needs at least one value per parameter, got {space}")
    keys = sorted(space)
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]
    if num_trials is None or num_trials >= len(grid):
        return grid
    if num_trials < 1:
        raise ConfigError(f"sweep num_trials must be at least 1, got {num_trials}")
    return random.Random(seed).sample(grid, num_trials)


def nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """{'train.optim.lr': 0.1} -> {'train': {'optim': {'lr': 0.1}}}."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def best_trial(results: list[dict[str, Any]], metric: str, mode: Literal["max", "min"]) -> dict[str, Any]:
    """The trial whose ``metrics[metric]`` is best; a metric missing from any trial is an error, not a skip."""
    missing = [r["trial"] for r in results if metric not in r["metrics"]]
    if missing:
        known = sorted(results[0]["metrics"]) if results else []
        raise ConfigError(f"sweep metric {metric!r} is missing from trials {missing}; the trials report {known}")
    pick = max if mode == "max" else min
    return pick(results, key=lambda r: r["metrics"][metric])


@flow(name="sweep", log_prints=True)
def sweep(profile: str = "train", overrides: dict[str, Any] | None = None,
          space: dict[str, list[Any]] | None = None, num_trials: int | None = None,
          metric: str = "val_accuracy", mode: Literal["max", "min"] = "max", seed: int = 0) -> dict[str, Any]:
    """Train one model per point of a search space and pick the best by ``metric``.

    Steps:
      1. Expand ``space`` (dotted config keys -> values; a grid, or ``num_trials`` sampled from it).
      2. Load and validate every trial's config before anything runs.
      3. Ensure the first trial's topic once (a trial whose point changes data settings produces its own).
      4. Train each trial in turn (each uses every Spark slot); each trial is its own MLflow run.
      5. Choose the best trial by ``metric`` (``mode`` max or min) and publish the trial table.
    """
    trials = expand_space(space or DEFAULT_SPACE, num_trials, seed)
    configs = [load_run_config(profile, deep_merge(overrides or {}, nest(trial))) for trial in trials]
    ensure_dataset_topics(configs[0], [configs[0].produce.variant])
    results = [{"trial": i, "params": trial, **train_model(cfg)}
               for i, (trial, cfg) in enumerate(zip(trials, configs))]
    best = best_trial(results, metric, mode)
    publish_sweep_table(results, best, metric)
    return {"best": best, "trials": results}


if __name__ == "__main__":
    sweep(profile="train")

"""The sweep's trials and its best one, as tasks: both backends try the same points and choose the same way."""

from __future__ import annotations

from typing import Any, Literal

from prefect import task

from kbit_core.config import KbitConfig
from kbit_core.trials import DEFAULT_SPACE, best_trial, expand_space


@task(name="sweep-trials")
def sweep_trials(
    base: KbitConfig, space: dict[str, list[Any]] | None, num_trials: int | None, seed: int
) -> list[tuple[dict[str, Any], KbitConfig]]:
    """Each point of ``space`` (default: the standard space; a grid, or ``num_trials`` sampled from it, seeded) with
    its validated config, before anything runs."""
    return [(trial, base.override(trial)) for trial in expand_space(space or DEFAULT_SPACE, num_trials, seed)]


@task(name="best-trial")
def choose_best_trial(results: list[dict[str, Any]], metric: str, mode: Literal["max", "min"]) -> dict[str, Any]:
    """The trial whose ``metrics[metric]`` is best (a diverged trial never is)."""
    return best_trial(results, metric, mode)

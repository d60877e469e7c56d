"""A sweep's trials: a search space becomes seeded trials, and the best trial is chosen (both sweep backends)."""

from __future__ import annotations

import itertools
import logging
import math
import random
from typing import Any, Literal

from kbit_core.errors import ConfigError, TrainingDivergedError

log = logging.getLogger(__name__)

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


def best_trial(results: list[dict[str, Any]], metric: str, mode: Literal["max", "min"]) -> dict[str, Any]:
    """The trial whose ``metrics[metric]`` is best; a metric missing from any trial is an error, not a skip.

    A trial whose metric is NaN or infinite (a diverged run) is never the best; every trial diverging raises
    TrainingDivergedError.
    """
    missing = [r["trial"] for r in results if metric not in r["metrics"]]
    if missing:
        known = sorted(results[0]["metrics"]) if results else []
        raise ConfigError(f"sweep metric {metric!r} is missing from trials {missing}; the trials report {known}")
    finite = [r for r in results if math.isfinite(r["metrics"][metric])]
    if not finite:
        raise TrainingDivergedError(
            f"sweep metric {metric!r} is NaN or infinite in every trial "
            f"({[r['metrics'][metric] for r in results]}): no trial can be the best"
        )
    if len(finite) < len(results):
        # NaN compares false both ways, so max/min would keep whichever NaN came first as the best.
        log.warning(
            "sweep: trials %s have a non-finite %s and cannot be the best",
            [r["trial"] for r in results if r not in finite],
            metric,
        )
    pick = max if mode == "max" else min
    return pick(finite, key=lambda r: r["metrics"][metric])

"""The sweep's pure parts: the search space becomes trials, and the best trial is chosen by the metric."""

from __future__ import annotations

import pytest

from kbit_core.config import nest_dotted
from kbit_core.errors import ConfigError, TrainingDivergedError
from kbit_core.trials import best_trial, expand_space

SPACE = {"train.optim.lr": [0.1, 0.01, 0.001], "train.global_batch_size": [32, 64]}


def test_grid_is_every_combination_once() -> None:
    trials = expand_space(SPACE)
    assert len(trials) == 6
    assert {(t["train.optim.lr"], t["train.global_batch_size"]) for t in trials} == {
        (lr, bs) for lr in SPACE["train.optim.lr"] for bs in SPACE["train.global_batch_size"]
    }


def test_sampled_trials_are_distinct_grid_points_and_reproducible() -> None:
    sampled = expand_space(SPACE, num_trials=4, seed=7)
    assert len(sampled) == 4 and all(t in expand_space(SPACE) for t in sampled)
    assert len({tuple(sorted(t.items())) for t in sampled}) == 4
    assert sampled == expand_space(SPACE, num_trials=4, seed=7)
    assert expand_space(SPACE, num_trials=100) == expand_space(SPACE)


@pytest.mark.parametrize(
    "space, num_trials, match",
    [
        ({}, None, "at least one value"),
        ({"train.optim.lr": []}, None, "at least one value"),
        (SPACE, 0, "num_trials must be at least 1"),
    ],
)
def test_bad_space_is_a_config_error(space: dict, num_trials: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        expand_space(space, num_trials)


def test_nest_builds_override_dicts() -> None:
    assert nest_dotted({"train.optim.lr": 0.1, "train.epochs": 2, "profile": "x"}) == {
        "train": {"optim": {"lr": 0.1}, "epochs": 2},
        "profile": "x",
    }


def test_best_trial_by_max_and_min() -> None:
    results = [
        {"trial": 0, "params": {}, "metrics": {"acc": 0.5, "loss": 0.9}},
        {"trial": 1, "params": {}, "metrics": {"acc": 0.8, "loss": 0.4}},
        {"trial": 2, "params": {}, "metrics": {"acc": 0.7, "loss": 0.3}},
    ]
    assert best_trial(results, "acc", "max")["trial"] == 1
    assert best_trial(results, "loss", "min")["trial"] == 2


def test_a_metric_missing_from_a_trial_is_an_error() -> None:
    results = [{"trial": 0, "params": {}, "metrics": {"acc": 0.5}}, {"trial": 1, "params": {}, "metrics": {}}]
    with pytest.raises(ConfigError, match=r"'acc' is missing from trials \[1\]"):
        best_trial(results, "acc", "max")


@pytest.mark.parametrize("mode", ["max", "min"])
def test_a_diverged_trial_is_never_the_best(mode: str) -> None:
    results = [
        {"trial": 0, "params": {}, "metrics": {"loss": float("nan")}},
        {"trial": 1, "params": {}, "metrics": {"loss": 0.4}},
        {"trial": 2, "params": {}, "metrics": {"loss": float("inf") if mode == "min" else float("-inf")}},
        {"trial": 3, "params": {}, "metrics": {"loss": 0.3}},
    ]
    assert best_trial(results, "loss", mode)["trial"] == (1 if mode == "max" else 3)


def test_every_trial_diverged_is_an_error() -> None:
    results = [
        {"trial": 0, "params": {}, "metrics": {"loss": float("nan")}},
        {"trial": 1, "params": {}, "metrics": {"loss": float("inf")}},
    ]
    with pytest.raises(TrainingDivergedError, match="'loss' is NaN or infinite in every trial"):
        best_trial(results, "loss", "min")

"""Flow `sweep` on both backends over the same space: Prefect trials in turn, Ray Tune trials under ASHA; the same
best trial, every trial visible in MLflow (the Ray Tune ones as children of one parent run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.sweep import sweep
from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import deep_merge
from kbit_core.service import Service
from tests.conftest import ray_head_settings
from tests.flows.helpers import delete_topics, flow_overrides

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.ray, pytest.mark.slow]

# The good point first: when the weak one reaches the first rung, ASHA has a better result there to cut against.
SPACE = {"train.optim.lr": [3e-3, 1e-6]}
TRAINING = {
    "dataset": {"num_records": 2000},
    "shard": {"split_rates": [0.8, 0.1, 0.1]},
    "train": {"epochs": 2, "global_batch_size": 64, "model": {"name": "mlp"}},
    "tracking": {"log_models": False, "system_metrics": False},
}


@pytest.fixture(autouse=True)
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def test_prefect_and_ray_tune_sweeps_pick_the_same_best_trial(
    broker: EmbeddedBroker, ray_head_service: Service, tmp_path: Path
) -> None:
    overrides = flow_overrides(broker, tmp_path, TRAINING)
    on_ray = deep_merge(overrides, {"sweep": {"backend": "ray-tune"}, "launch": ray_head_settings(ray_head_service)})

    by_prefect = sweep(profile="train", overrides=overrides, space=SPACE, return_state=True).result()
    by_tune = sweep(profile="train", overrides=on_ray, space=SPACE, return_state=True).result()

    assert by_prefect["best"]["params"] == by_tune["best"]["params"] == {"train.optim.lr": 3e-3}
    assert [t["params"] for t in by_tune["trials"]] == [t["params"] for t in by_prefect["trials"]]
    assert [t["epochs"] for t in by_tune["trials"]] == [2, 1], "ASHA stops the weak trial at its first rung"
    client = MlflowClient(overrides["tracking"]["tracking_uri"])
    for trial in by_prefect["trials"]:
        assert client.get_run(trial["mlflow_run_id"]).info.status == "FINISHED"
    parent = client.get_run(by_tune["mlflow_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{by_tune['mlflow_run_id']}'"
    )
    assert sorted(r.info.run_id for r in children) == sorted(t["mlflow_run_id"] for t in by_tune["trials"])
    best_child = client.get_run(by_tune["best"]["mlflow_run_id"])
    assert best_child.data.tags["kbit.best_trial"] == "true"
    assert best_child.data.params["train.optim.lr"] == "0.003"
    assert best_child.data.metrics["val/accuracy"] == pytest.approx(by_tune["best"]["metrics"]["val_accuracy"])

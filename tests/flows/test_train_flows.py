"""Flows `train` and `sweep` on the real broker and Spark: trained, recorded in MLflow, best trial chosen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.artifacts import Artifact

from flows.sweep import sweep
from flows.train import train
from kbit_core.brokers.broker import EmbeddedBroker
from tests.flows.helpers import delete_topics, flow_overrides, task_runs

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

TINY_TRAINING = {
    "train": {"epochs": 1, "model": {"name": "mlp"}},
    "tracking": {"log_models": False, "system_metrics": False},
}


def all_run_ids(client: MlflowClient) -> list[str]:
    """Every run in the test's own store (each test has its own sqlite file)."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_id for r in client.search_runs(experiments)]


@pytest.fixture(autouse=True)
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def test_train_flow_trains_and_records_the_run(broker: EmbeddedBroker, tmp_path: Path) -> None:
    overrides = flow_overrides(broker, tmp_path, TINY_TRAINING)

    state = train(profile="train", overrides=overrides, return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    assert 0.0 <= summary["metrics"]["val_accuracy"] <= 1.0 and summary["metrics"]["epochs"] == 1
    client = MlflowClient(overrides["tracking"]["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.model.name"] == "mlp"
    assert run.data.metrics["val/accuracy"] == pytest.approx(summary["metrics"]["val_accuracy"])
    assert all_run_ids(client) == [summary["mlflow_run_id"]], "one training, one MLflow run"
    assert set(task_runs(state)) == {
        "load-config",
        "ensure-topics",
        "train",
        "mlflow-run-url",
        "publish-training-summary",
    }
    # Both ways between the UIs: the run names its flow run; the flow run's artifact names the run (a sqlite store
    # has no UI page to link to).
    assert run.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    published = Artifact.get("kbit-train-train")
    assert published is not None and f"MLflow run `{summary['mlflow_run_id']}`" in published.data
    assert "| val_accuracy |" in published.data


@pytest.mark.slow
def test_sweep_trains_every_trial_and_picks_the_best(broker: EmbeddedBroker, tmp_path: Path) -> None:
    overrides = flow_overrides(broker, tmp_path, TINY_TRAINING)

    state = sweep(
        profile="train",
        overrides=overrides,
        space={"train.optim.lr": [1e-4, 3e-3]},
        metric="val_loss",
        mode="min",
        return_state=True,
    )

    assert state.is_completed(), state.message
    out = state.result()
    assert [t["params"] for t in out["trials"]] == [{"train.optim.lr": 1e-4}, {"train.optim.lr": 3e-3}]
    assert out["best"]["metrics"]["val_loss"] == min(t["metrics"]["val_loss"] for t in out["trials"])
    client = MlflowClient(overrides["tracking"]["tracking_uri"])
    lrs = {client.get_run(t["mlflow_run_id"]).data.params["train.optim.lr"] for t in out["trials"]}
    assert lrs == {"0.0001", "0.003"}
    assert sorted(all_run_ids(client)) == sorted(t["mlflow_run_id"] for t in out["trials"]), "one MLflow run per trial"

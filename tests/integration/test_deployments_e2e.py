"""End to end: a real Prefect server, worker and MLflow server (kbit_core.stack), deployments from prefect.yaml,
`prefect deployment run --watch` through the worker, and the runs found in MLflow afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from kbit_core.config import KbitConfig, load_config
from kbit_core.stack import PROJECT_ROOT, LocalStack
from tasks.config import profile_path
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.kafka, pytest.mark.spark]

EXPERIMENT = "kbit-e2e"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The whole local stack on free ports in a temporary run directory, deployed, and stopped afterwards."""
    cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path_factory.mktemp("e2e") / "kbit"),
            "kafka": {"embedded": {"port": free_port(), "controller_port": free_port()}},
            "stack": {"prefect_port": free_port(), "mlflow_port": free_port(), "work_pool": "kbit-e2e"},
        }
    )
    s = LocalStack(cfg)
    try:
        s.up()
        yield s
    finally:
        s.down()


def run_deployment(stack: LocalStack, name: str, overrides: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`prefect deployment run NAME --watch` with the overrides that keep the run inside the test's stack."""
    inside = {
        "workdir": str(stack.run_dir),
        "kafka": {"embedded": stack.cfg.kafka.embedded.model_dump()},
        "tracking": {"experiment": EXPERIMENT},
    }
    params = {"overrides": {**inside, **overrides}}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "deployment",
            "run",
            name,
            "--params",
            json.dumps(params),
            "--watch",
            "--watch-interval",
            "1",
            "--watch-timeout",
            "480",
        ],
        env={**os.environ, **stack.prefect_env()},
        capture_output=True,
        text=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )


def test_deployments_are_stored_resolved_and_nightly_is_scheduled(stack: LocalStack) -> None:
    names = {f"{d['name']}" for d in stack.deployments()}
    assert {"smoke", "nightly", "ddp-cpu", "ddp-cluster", "smoke-topics", "train-hyperparameters"} <= names
    nightly = json.loads(stack.prefect_cli("deployment", "inspect", "benchmark/nightly", "-o", "json"))
    assert nightly["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
    assert nightly["schedules"][0]["schedule"]["timezone"] == "UTC"
    assert nightly["parameters"] == {"profile": "nightly", "compare_with_previous": True}
    step = nightly["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]
    assert Path(step["directory"]) == PROJECT_ROOT
    assert nightly["job_variables"]["env"]["MLFLOW_TRACKING_URI"] == stack.mlflow_url
    assert nightly["work_pool_name"] == "kbit-e2e"


def test_a_bad_config_fails_the_run_and_the_watch(stack: LocalStack) -> None:
    proc = run_deployment(stack, "produce/smoke-topics", {"train": {"epochs": 0}})

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Failed" in proc.stdout


def test_smoke_benchmark_runs_through_the_worker_into_mlflow(stack: LocalStack) -> None:
    proc = run_deployment(
        stack, "benchmark/smoke", {"dataset": {"num_records": 240}, "bench": {"iterations": 2, "warmup_iterations": 0}}
    )

    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    client = MlflowClient(tracking_uri=stack.mlflow_url)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, "the flow run did not log to the stack's MLflow server"
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`kbit.kind` = 'benchmark'")
    assert parent.info.status == "FINISHED" and parent.data.tags["kbit.profile"] == "smoke"
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == len(load_config(profile_path("smoke")).bench.variants)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "benchmark")}
    assert "benchmark/stats.json" in artifacts

    summary = json.loads(stack.prefect_cli("artifact", "inspect", "kbit-benchmark-smoke", "-o", "json"))
    assert parent.info.run_id in summary[0]["data"] and stack.mlflow_url in summary[0]["data"]

"""The team stack on the bed's driver host (`kbit cluster up --team-stack`): both servers refuse a request without the
login over the bed address, a run logged from a node host stores its artifact in s3proxy's store through MLflow, and
the nightly deployment (the bed-sized profile) run by the stack's worker ends COMPLETED, its MLflow run in PostgreSQL
and read back by `kbit history`; and the one-host stack's two faults on the bed's stack (PostgreSQL restarted mid-flow,
s3proxy stopped while a run logs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kbit_core import bed_stack
from kbit_core import testbed as bed
from kbit_core.servers import logins
from kbit_core.servers.object_store import ARTIFACT_BUCKET, ObjectStoreError, s3proxy_jar, store_dir
from kbit_core.servers.postgres import PostgresError, find_bindir
from kbit_core.stack import PROJECT_ROOT, LocalStack
from kbit_core.testbed import BedState
from kbit_core.testbed.network import Host, in_host
from tests.conftest import installed_or_skip
from tests.integration.test_stack_team import (
    check_object_store_outage_fails_both_runs,
    check_postgresql_restart_ridden_out,
    database_rows,
    status_without_login,
)

pytestmark = [pytest.mark.prefect, pytest.mark.spark, pytest.mark.slow, pytest.mark.kafka]

NIGHTLY_BED = PROJECT_ROOT / "deployments" / "profiles" / "nightly-bed.yaml"
# What a rank on a node host does with MLflow: a run with a metric and an artifact, through the server's proxy (the
# node has no S3 key, only the login in its environment).
NODE_RUN = """
import sys, mlflow
mlflow.set_experiment("kbit-bed-node")
with mlflow.start_run() as run:
    mlflow.log_metric("loss", 0.5)
    mlflow.log_text(sys.argv[1], "node/hello.txt")
print(run.info.run_id)
"""


@pytest.fixture(scope="module")
def bed_team(testbed: BedState) -> Iterator[LocalStack]:
    """The session's bed with its team stack; stopped again afterwards when the bed came up without one."""
    installed_or_skip(find_bindir, PostgresError)
    installed_or_skip(s3proxy_jar, ObjectStoreError)
    before = bed.state_path(testbed.bed_dir).read_text()
    state = bed_stack.start(testbed.bed_dir)
    assert state.team_stack is not None
    print(f"the bed's team stack started in {state.team_stack.up_s} s")
    yield bed_stack.team_stack(state)
    if testbed.team_stack is None:
        bed_stack.stop(testbed.bed_dir)
        bed.state_path(testbed.bed_dir).write_text(before)  # as the session's bed was, whoever brought it up


def test_the_team_stack_runs_on_the_drivers_bed_address_behind_the_login(bed_team: LocalStack) -> None:
    driver = bed.load_state(bed_team.cfg.run_dir.parent).driver
    assert bed_team.prefect_api_url.startswith(f"http://{driver.address}:")
    assert bed_team.mlflow_url.startswith(f"http://{driver.address}:")
    shown = bed_stack.with_team_stack(bed.status(bed_team.cfg.run_dir.parent))
    team = {p.name: p for p in shown.processes if p.host == driver.name and p.name in ("postgres", "s3proxy")}
    assert shown.up and set(team) == {"postgres", "s3proxy"} and all(p.alive for p in team.values())
    assert status_without_login(f"{bed_team.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert status_without_login(f"{bed_team.prefect_api_url}/work_pools/{bed_stack.WORK_POOL}") == 401


def test_a_run_on_a_node_host_stores_its_artifact_in_the_object_store(bed_team: LocalStack, tmp_path: Path) -> None:
    node = bed.load_state(bed_team.cfg.run_dir.parent).nodes[0]
    text = f"logged on {node.name} ({tmp_path.name})"
    env = {**os.environ, "MLFLOW_TRACKING_URI": bed_team.mlflow_url, **logins.client_env(bed_team.run_dir)}
    proc = subprocess.run(
        in_host(Host(node.name, node.address, node.netns), [sys.executable, "-c", NODE_RUN, text]),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]
    stored = [p for p in (store_dir(bed_team.run_dir) / ARTIFACT_BUCKET).rglob("hello.txt") if run_id in str(p)]
    assert [p.read_text() for p in stored] == [text]


def nightly_profile(state: BedState, folder: Path) -> Path:
    """The bed-sized nightly profile on this session's bed (its TLS files and password file), in ``folder``."""
    kafka = {k.removeprefix("kafka."): v for k, v in state.kafka_overrides().items()}
    profile = {
        "extends": str(NIGHTLY_BED),
        "workdir": str(folder / "work"),
        "kafka": kafka,
        "bench": {"output_dir": str(folder / "reports")},
    }
    path = folder / "nightly-bed.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def mlflow_runs(stack: LocalStack, experiment: str) -> list[tuple[str, str]]:
    """(run id, status) of the experiment's top-level runs, read from MLflow's PostgreSQL database."""
    rows = database_rows(
        stack,
        "mlflow",
        "SELECT r.run_uuid, r.status FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id "
        "WHERE e.name = %s AND NOT EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid "
        "AND t.key = 'mlflow.parentRunId')",
        (experiment,),
    )
    return [(row[0], row[1]) for row in rows]


@pytest.mark.timeout(1800)  # the stack's worker runs a Spark benchmark across the node hosts; minutes on 2 cores
def test_the_nightly_deployment_runs_on_the_bed_and_kbit_history_reads_it_back(
    bed_team: LocalStack, tmp_path: Path
) -> None:
    state = bed.load_state(bed_team.cfg.run_dir.parent)
    profile = nightly_profile(state, tmp_path)
    experiment = "kbit-nightly-bed"
    before = {run for run, _ in mlflow_runs(bed_team, experiment)}
    env = {**os.environ, **bed_team.prefect_env()}
    args = ["deployment", "run", "benchmark/nightly", "--param", f"profile={profile}", "--watch"]
    watched = subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=env, capture_output=True, text=True, timeout=1700
    )
    assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr[-3000:]
    assert "COMPLETED" in watched.stdout.upper()
    new = [(run, status) for run, status in mlflow_runs(bed_team, experiment) if run not in before]
    assert [status for _, status in new] == ["FINISHED"]
    history = subprocess.run(
        [sys.executable, "-m", "kbit_core", "history", "--config", str(profile), "--json"],
        env={**os.environ, "MLFLOW_TRACKING_URI": bed_team.mlflow_url, **logins.client_env(bed_team.run_dir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert history.returncode == 0, history.stdout[-3000:] + history.stderr[-3000:]
    assert new[0][0] in json.dumps(json.loads(history.stdout))


def bed_login(bed_team: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's MLflow login (its in-process client, the flows it starts) as the bed's stack's, whatever login
    an earlier test of the session left in the environment."""
    for name, value in logins.client_env(bed_team.run_dir).items():
        monkeypatch.setenv(name, value)


def test_postgresql_restarted_mid_flow_on_the_bed_is_ridden_out(
    bed_team: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed_login(bed_team, monkeypatch)
    check_postgresql_restart_ridden_out(bed_team, tmp_path)


def test_object_store_stopped_on_the_bed_fails_both_runs_in_one_line(
    bed_team: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed_login(bed_team, monkeypatch)
    check_object_store_outage_fails_both_runs(bed_team, tmp_path, monkeypatch)

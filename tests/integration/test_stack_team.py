"""The team profile's stack (deployments/profiles/team.yaml): Prefect and MLflow on kbit's PostgreSQL, MLflow's
artifacts in s3proxy, both servers behind kbit's login; a training run logged through the login lands in the object
store, a flow run in PostgreSQL, a browser gets each UI only with the login, a wrong password is one line, and no
password shows on a command line or in a log; a PostgreSQL restart mid-flow is ridden out, an object store stopped
mid-run fails both runs in one line, and an initdb that cannot write its data directory is one line."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from PIL import Image

from kbit_core.config import KbitConfig, load_config
from kbit_core.errors import TrackingError
from kbit_core.servers import logins
from kbit_core.servers.object_store import ARTIFACT_BUCKET, ObjectStoreError, s3proxy_jar, store_dir
from kbit_core.servers.postgres import PostgresError, data_dir, find_bindir
from kbit_core.stack import LocalStack, StackError
from kbit_core.tracking import make_tracker
from kbit_core.tracking.client import mlflow_client
from tests.conftest import REQUIRE_APACHE_KAFKA, free_port, installed_or_skip, processes_mentioning, unavailable

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deployments" / "profiles" / "team.yaml"
SCREENSHOTS = ROOT / "scripts" / "ui_screenshots.py"
FLOW = "from prefect import flow\n@flow(name='kbit-team-check')\ndef check():\n    return 1\ncheck()\n"


# Not 127.0.0.1: like a bed's driver address, one that PostgreSQL's pg_hba.conf and MLflow's allowed hosts do not
# name by default, so that what kbit adds for a non-default stack.host runs here too.
STACK_HOST = "127.0.0.2"


def team_config(workdir: Path) -> KbitConfig:
    """The team profile as shipped, on free ports of :data:`STACK_HOST` and in ``workdir``."""
    ports = {name: free_port() for name in ("prefect_port", "mlflow_port", "postgres_port", "s3_port")}
    return load_config(PROFILE).override(
        {
            "workdir": str(workdir),
            "stack.host": STACK_HOST,
            "stack.work_pool": "kbit-team-test",
            "tracking.tracking_uri": f"http://{STACK_HOST}:{ports['mlflow_port']}",
            "tracking.experiment": "kbit-team-test",
            "tracking.system_metrics": False,
            **{f"stack.{name}": port for name, port in ports.items()},
        }
    )


@pytest.fixture(scope="module")
def team_stack(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """PostgreSQL, s3proxy and the Prefect and MLflow servers of the team profile, started once for this module.

    The workdir is neither under pytest's tmp_path nor under $TMPDIR: as root PostgreSQL runs as the ``postgres``
    user, who cannot enter pytest-of-root or the suite's own TMPDIR (scripts/run.sh's mktemp -d), both mode 0700."""
    installed_or_skip(find_bindir, PostgresError)
    installed_or_skip(s3proxy_jar, ObjectStoreError)
    root = Path(tempfile.mkdtemp(prefix="kbit-team-", dir="/tmp"))
    os.chmod(root, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    stack = LocalStack(team_config(root / "kbit"))
    try:
        stack.team.start()
        stack.prefect_server.start()
        stack.mlflow_server.start()
        yield stack
    finally:
        stack.down()
    assert processes_mentioning(str(stack.run_dir)) == []


@pytest.fixture
def no_login_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test process is given by kbit's login goes again after the test."""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PREFECT_API_AUTH_STRING"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)


def status_without_login(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_both_servers_refuse_a_request_without_the_login(team_stack: LocalStack, no_login_in_env: None) -> None:
    assert status_without_login(f"{team_stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert status_without_login(f"{team_stack.prefect_api_url}/work_pools/kbit-team-test") == 401
    # the same servers seen from another workdir, with a login of its own: kbit's Prefect client says so in one line
    anonymous = LocalStack(team_stack.cfg.override({"workdir": str(team_stack.run_dir.parent / "anonymous")}))
    with pytest.raises(StackError, match=r"answered 401") as refused:
        anonymous.deployments()
    assert "\n" not in str(refused.value)


def test_training_run_logged_through_the_login_lands_in_the_object_store(
    team_stack: LocalStack, no_login_in_env: None
) -> None:
    cfg = team_stack.cfg
    tracker = make_tracker(cfg)
    with tracker.run(cfg, name="team-train", kind="train") as run_id:
        tracker.log_training(run_id, {"history": [{"epoch": 0, "train_loss": 1.5}, {"epoch": 1, "train_loss": 0.9}]})
    client = mlflow_client(cfg)
    assert client.get_run(run_id).info.status == "FINISHED"
    names = {item.path for item in client.list_artifacts(run_id)}
    stored = [p for p in (store_dir(cfg.run_dir) / ARTIFACT_BUCKET).rglob("*") if p.is_file()]
    assert names and {p.name for p in stored} >= names
    assert all(run_id in str(p) for p in stored if p.name in names)
    local = Path(client.download_artifacts(run_id, sorted(names)[0], str(cfg.run_dir / "readback")))
    assert local.read_bytes() == next(p for p in stored if p.name == local.name).read_bytes()


def database_rows(stack: LocalStack, database: str, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The rows ``query`` reads from one of the stack's databases, as the user that owns it."""
    user = {"prefect": logins.PREFECT_DB_USER, "mlflow": logins.MLFLOW_DB_USER}[database]
    st = stack.cfg.stack
    conn = psycopg2.connect(
        host=st.host,
        port=st.postgres_port,
        dbname=database,
        user=user,
        password=logins.password(stack.run_dir, user),
    )
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall()
    finally:
        conn.close()


def test_a_flow_run_is_recorded_in_postgresql(team_stack: LocalStack) -> None:
    env = {**os.environ, **team_stack.prefect_env()}
    subprocess.run([sys.executable, "-c", FLOW], env=env, check=True, timeout=600, capture_output=True)
    rows = database_rows(
        team_stack,
        "prefect",
        "SELECT fr.state_type FROM flow_run fr JOIN flow f ON f.id = fr.flow_id WHERE f.name = %s",
        ("kbit-team-check",),
    )
    assert [row[0] for row in rows] == ["COMPLETED"]


def test_a_browser_gets_each_ui_only_with_the_login(team_stack: LocalStack, tmp_path: Path) -> None:
    """The screenshot script's --login pass in headless Chromium, with what `kbit stack env` exports: without the
    login MLflow answers the browser 401 and asks for a basic-auth login, and Prefect's UI shows its login page;
    logged in (MLflow's login as a header, Prefect's auth string typed into that page), both show their first page."""
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        unavailable(
            "no chromium on PATH (apt-get install chromium): the UIs' login is not checked", REQUIRE_APACHE_KAFKA
        )
    env = {**os.environ, **team_stack.prefect_env(), "MLFLOW_TRACKING_URI": team_stack.mlflow_url}
    out = tmp_path / "shots"
    done = subprocess.run(
        [sys.executable, str(SCREENSHOTS), "--login", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    mlflow, prefect = team_stack.mlflow_url, team_stack.prefect_ui_url
    assert (
        seen["login_0_mlflow_without_login.png"]
        == f'{mlflow}/ -> HTTP 401, asks for a login (Basic realm="mlflow"), at {mlflow}/'
    )
    assert re.fullmatch(
        rf"{prefect}/ -> HTTP 200, at {prefect}/(v2/)?login\b.*", seen["login_1_prefect_without_login.png"]
    )
    assert seen["login_2_mlflow_logged_in.png"] == f"{mlflow}/ -> HTTP 200, at {mlflow}/"
    logged_in = seen["login_3_prefect_logged_in.png"]
    assert logged_in.startswith(f"{prefect}/ -> HTTP 200, at {prefect}/") and "login" not in logged_in
    for name in seen:
        with Image.open(out / name) as shot:
            assert (shot.size, shot.mode) == ((1600, 1000), "P")
    assert not [s for s in logins.secret_values(team_stack.run_dir) if s in done.stdout + done.stderr]


def test_a_wrong_mlflow_password_is_one_line(team_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", logins.LOGIN_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    with pytest.raises(TrackingError) as refused:
        mlflow_client(team_stack.cfg)
    assert "refused the login of user 'kbit' (401)" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_no_password_on_a_command_line_in_a_log_or_readable_by_others(team_stack: LocalStack) -> None:
    secrets = logins.secret_values(team_stack.run_dir)
    assert len(secrets) >= 5  # postgres admin and two users, s3proxy, the login, MLflow's CSRF key
    services = [team_stack.prefect_server, team_stack.mlflow_server, *team_stack.team.services]
    texts = [Path(f"/proc/{svc.pid()}/cmdline").read_bytes().decode() for svc in services]
    texts += [svc.log_path.read_text(errors="replace") for svc in services]
    texts += [str(team_stack.status()), json.dumps(team_stack.cfg.to_dict())]
    assert not [s for s in secrets for text in texts if s in text]
    for path in logins.credentials_dir(team_stack.run_dir).iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_an_initdb_that_cannot_write_its_data_directory_is_one_line(tmp_path: Path) -> None:
    """PostgreSQL's first start where its data directory cannot be made: as root, initdb (run as the ``postgres``
    user) cannot enter a mode-0700 folder of root's; as anyone else, the folder above the data is read-only."""
    installed_or_skip(find_bindir, PostgresError)
    os.chmod(tmp_path, 0o700)
    stack = LocalStack(team_config(tmp_path / "kbit"))
    data = data_dir(stack.run_dir)
    data.parent.mkdir(parents=True)
    os.chmod(data.parent, 0o500)
    with pytest.raises(PostgresError) as failed:
        stack.team.start()
    assert "\n" not in str(failed.value) and str(data) in str(failed.value)
    assert str(failed.value).startswith((f"initdb {data} failed", f"cannot create PostgreSQL's data directory {data}"))
    assert stack.team.postgres is not None and stack.team.postgres.pid() is None


# -- faults: a server of the team stack goes away while a flow logs its run ---------------------------------------------
FAULT_FLOW = Path(__file__).with_name("team_fault_flow.py")
POSTGRES_OUTAGE_S = 10.0


def start_fault_flow(stack: LocalStack, folder: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The two-step flow of team_fault_flow.py against ``stack``, as a flow run a worker starts (the stack's login)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(stack.cfg.to_dict()))
    return subprocess.Popen(
        [sys.executable, str(FAULT_FLOW), str(config), str(folder / "gate")],
        env={**os.environ, **stack.prefect_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_until(condition: Callable[[], bool], what: str, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the flow exited (code {proc.returncode}) before {what}: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.2)


def first_step_stored(proc: subprocess.Popen[str], folder: Path) -> dict[str, str]:
    """The MLflow run and flow run ids, once the flow has stored its first step and waits at its gate."""
    ready = folder / "gate.ready"
    wait_until(ready.exists, f"{ready}", proc)
    return json.loads(ready.read_text())


def flow_run_state(stack: LocalStack, flow_run_id: str) -> dict[str, Any]:
    login = base64.b64encode((stack.prefect_login or "").encode()).decode()
    request = urllib.request.Request(
        f"{stack.prefect_api_url}/flow_runs/{flow_run_id}", headers={"Authorization": f"Basic {login}"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["state"]


def stored_steps(stack: LocalStack, run_id: str) -> tuple[str, dict[str, str], list[float], set[str]]:
    """What MLflow holds of the flow's run: its status, params, step metric and artifacts."""
    client = mlflow_client(stack.cfg)
    run = client.get_run(run_id)
    steps = [m.value for m in client.get_metric_history(run_id, "step")]
    artifacts = {item.path for item in client.list_artifacts(run_id)}
    params = {k: v for k, v in run.data.params.items() if k.startswith("step")}
    return run.info.status, params, steps, artifacts


def test_postgresql_restarted_mid_flow_is_ridden_out(team_stack: LocalStack, tmp_path: Path) -> None:
    check_postgresql_restart_ridden_out(team_stack, tmp_path)


def check_postgresql_restart_ridden_out(team_stack: LocalStack, tmp_path: Path) -> None:
    """PostgreSQL (both servers' store) goes down between the flow's two steps and comes back while the second one
    is retried: the flow run and the MLflow run finish, with both steps and nothing lost (here and on the bed)."""
    postgres = team_stack.team.postgres
    assert postgres is not None
    proc = start_fault_flow(team_stack, tmp_path)
    ids = first_step_stored(proc, tmp_path)
    postgres.stop()
    (tmp_path / "gate").touch()
    # the outage's length, not a wait for anything: what the flow asks meanwhile waits (Prefect) or is retried
    # (MLflow's 500s) until the database is back; a slow flow asks after, on pooled connections the restart broke
    time.sleep(POSTGRES_OUTAGE_S)
    postgres.start()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert flow_run_state(team_stack, ids["flow_run_id"])["type"] == "COMPLETED"
    assert stored_steps(team_stack, ids["run_id"]) == (
        "FINISHED",
        {"step0": "0", "step1": "1"},
        [0.0, 1.0],
        {"config.json", "step0.txt", "step1.txt"},
    )


def test_object_store_stopped_while_a_run_logs_fails_both_runs_in_one_line(
    team_stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_object_store_outage_fails_both_runs(team_stack, tmp_path, monkeypatch)


def check_object_store_outage_fails_both_runs(
    team_stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3proxy stops between the flow's two steps: the second artifact's upload fails (after MLflow's retries, cut
    short here) in one line naming the store, the flow run and the MLflow run end FAILED, the first step's artifact
    reads back once the store is up again, and the next run is clean (here and on the bed)."""
    s3proxy = team_stack.team.s3proxy
    assert s3proxy is not None
    quick_retries = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    proc = start_fault_flow(team_stack, tmp_path / "broken", quick_retries)
    ids = first_step_stored(proc, tmp_path / "broken")
    s3proxy.stop()
    try:
        (tmp_path / "broken" / "gate").touch()
        output, _ = proc.communicate(timeout=600)
        # a run that cannot even store its settings (config.json) ends FAILED too, not RUNNING
        for name, value in quick_retries.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(TrackingError, match="storing artifact 'config.json'"):
            with make_tracker(team_stack.cfg).run(team_stack.cfg, name="no-settings", kind="train"):
                pass
    finally:
        s3proxy.start()
    unstored = mlflow_client(team_stack.cfg).search_runs(
        [ids["experiment_id"]], filter_string="attributes.run_name = 'no-settings'"
    )
    assert [run.info.status for run in unstored] == ["FAILED"]
    st = team_stack.cfg.stack
    line = (
        f"MLflow run {ids['run_id']}: storing artifact 'step1.txt' through {team_stack.mlflow_url} failed: "
        f"kbit's object store (s3proxy) at http://{st.host}:{st.s3_port} does not answer"
    )
    assert proc.returncode != 0 and line in output, output[-3000:]
    state = flow_run_state(team_stack, ids["flow_run_id"])
    assert state["type"] == "FAILED" and line in state["message"] and "\n" not in state["message"]
    status, params, steps, artifacts = stored_steps(team_stack, ids["run_id"])
    # the second step's metric and param were stored before its artifact failed: a FAILED run keeps all it logged
    assert (status, params, steps) == ("FAILED", {"step0": "0", "step1": "1"}, [0.0, 1.0])
    assert artifacts == {"config.json", "step0.txt"}
    read = mlflow_client(team_stack.cfg).download_artifacts(ids["run_id"], "step0.txt", str(tmp_path / "read"))
    assert Path(read).read_text() == (tmp_path / "broken" / "step0.txt").read_text()

    (tmp_path / "next").mkdir()
    (tmp_path / "next" / "gate").touch()
    proc = start_fault_flow(team_stack, tmp_path / "next")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    ids = json.loads((tmp_path / "next" / "gate.ready").read_text())
    assert stored_steps(team_stack, ids["run_id"])[::3] == ("FINISHED", {"config.json", "step0.txt", "step1.txt"})

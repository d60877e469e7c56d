"""The team profile's stack (deployments/profiles/team.yaml): Prefect and MLflow on kbit's PostgreSQL, MLflow's
artifacts in s3proxy, both servers behind kbit's login; a training run logged through the login lands in the object
store, a flow run in PostgreSQL, a wrong password is one line, and no password shows on a command line or in a log."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest

from kbit_core.config import KbitConfig, load_config
from kbit_core.errors import TrackingError
from kbit_core.servers import logins
from kbit_core.servers.object_store import ARTIFACT_BUCKET, ObjectStoreError, s3proxy_jar, store_dir
from kbit_core.servers.postgres import PostgresError, find_bindir
from kbit_core.stack import LocalStack, StackError
from kbit_core.tracking import make_tracker
from kbit_core.tracking.client import mlflow_client
from tests.conftest import free_port, installed_or_skip, processes_mentioning

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

PROFILE = Path(__file__).resolve().parents[2] / "deployments" / "profiles" / "team.yaml"
FLOW = "from prefect import flow\n@flow(name='kbit-team-check')\ndef check():\n    return 1\ncheck()\n"


def team_config(workdir: Path) -> KbitConfig:
    """The team profile as shipped, on free ports and in ``workdir``."""
    ports = {name: free_port() for name in ("prefect_port", "mlflow_port", "postgres_port", "s3_port")}
    return load_config(PROFILE).override(
        {
            "workdir": str(workdir),
            "stack.work_pool": "kbit-team-test",
            "tracking.tracking_uri": f"http://127.0.0.1:{ports['mlflow_port']}",
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


def test_a_flow_run_is_recorded_in_postgresql(team_stack: LocalStack) -> None:
    env = {**os.environ, **team_stack.prefect_env()}
    subprocess.run([sys.executable, "-c", FLOW], env=env, check=True, timeout=600, capture_output=True)
    st = team_stack.cfg.stack
    conn = psycopg2.connect(
        host=st.host,
        port=st.postgres_port,
        dbname="prefect",
        user=logins.PREFECT_DB_USER,
        password=logins.password(team_stack.run_dir, logins.PREFECT_DB_USER),
    )
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT fr.state_type FROM flow_run fr JOIN flow f ON f.id = fr.flow_id WHERE f.name = %s",
                ("kbit-team-check",),
            )
            assert [row[0] for row in cur.fetchall()] == ["COMPLETED"]
    finally:
        conn.close()


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

"""The stack's generated credentials: made once, kept mode 0600, handed to clients, never printed by `kbit stack env`."""

from __future__ import annotations

import stat
from pathlib import Path

from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.servers import logins


def test_a_password_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    first = logins.password(tmp_path, "login")
    assert logins.password(tmp_path, "login") == first and len(first) >= 40
    path = logins.credentials_dir(tmp_path) / "login.password"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_clients_get_a_login_only_where_the_stack_made_one(tmp_path: Path) -> None:
    assert logins.client_env(tmp_path) == {} and logins.stored_password(tmp_path, "login") is None
    secret = logins.password(tmp_path, "login")
    env = logins.client_env(tmp_path)
    assert env["MLFLOW_TRACKING_PASSWORD"] == secret and env["PREFECT_API_AUTH_STRING"] == f"kbit:{secret}"


def test_stack_env_reads_the_login_from_its_file_and_never_prints_it(tmp_path: Path) -> None:
    workdir = tmp_path / "kbit"
    result = CliRunner().invoke(app, ["stack", "env", "--set", f"workdir={workdir}", "--set", "stack.auth=true"])
    assert result.exit_code == 0, result.output
    secret = logins.password(workdir, "login")
    assert secret not in result.output
    assert f'export MLFLOW_TRACKING_PASSWORD="$(cat {workdir}/state/credentials/login.password)"' in result.output
    assert "export PREFECT_API_AUTH_STRING=kbit:" in result.output

"""The credentials kbit generates for the stack's own servers (PostgreSQL users, s3proxy's key, the MLflow and Prefect
logins), each in a mode-0600 file under ``<workdir>/state/credentials``, and the environment that hands them to
clients: no password is ever on a command line, in a URL or in a config."""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path

# The user names kbit gives its logins; the passwords are generated once per workdir and kept.
POSTGRES_ADMIN = "kbit_admin"
PREFECT_DB_USER = "kbit_prefect"
MLFLOW_DB_USER = "kbit_mlflow"
S3_ACCESS_KEY = "kbit"
LOGIN_USER = "kbit"


def state_dir(run_dir: Path) -> Path:
    """Where the team profile's servers keep their data and credentials."""
    return run_dir / "state"


def credentials_dir(run_dir: Path) -> Path:
    return state_dir(run_dir) / "credentials"


def write_private(path: Path, text: str) -> Path:
    """``path`` holding ``text``, readable by its owner only (mode 0600 from its creation on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def password(run_dir: Path, name: str) -> str:
    """The password called ``name`` of this workdir's stack, generated (256 bits, URL-safe) on first use."""
    path = credentials_dir(run_dir) / f"{name}.password"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    write_private(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


def stored_password(run_dir: Path, name: str) -> str | None:
    """The password ``name`` if this workdir's stack generated it (a client never creates one), else None."""
    path = credentials_dir(run_dir) / f"{name}.password"
    return path.read_text().strip() or None if path.is_file() else None


def pgpass(run_dir: Path, host: str, port: int) -> Path:
    """A libpq/asyncpg password file for kbit's PostgreSQL users (PGPASSFILE): the database URLs carry no password."""
    lines = [
        f"{host}:{port}:*:{user}:{password(run_dir, user)}\n"
        for user in (POSTGRES_ADMIN, PREFECT_DB_USER, MLFLOW_DB_USER)
    ]
    return write_private(credentials_dir(run_dir) / "pgpass", "".join(lines))


def client_env(run_dir: Path) -> dict[str, str]:
    """What kbit's clients need to log in to this workdir's MLflow and Prefect servers: empty without ``stack.auth``
    (no login was ever generated)."""
    secret = stored_password(run_dir, "login")
    if secret is None:
        return {}
    return {
        "MLFLOW_TRACKING_USERNAME": LOGIN_USER,
        "MLFLOW_TRACKING_PASSWORD": secret,
        "PREFECT_API_AUTH_STRING": f"{LOGIN_USER}:{secret}",
    }


def shell_exports(run_dir: Path) -> dict[str, str]:
    """:func:`client_env` as shell words that read the password from its file when evaluated (`kbit stack env`):
    the password itself is never printed."""
    path = credentials_dir(run_dir) / "login.password"
    if stored_password(run_dir, "login") is None:
        return {}
    read = f'"$(cat {shlex.quote(str(path))})"'
    return {
        "MLFLOW_TRACKING_USERNAME": LOGIN_USER,
        "MLFLOW_TRACKING_PASSWORD": read,
        "PREFECT_API_AUTH_STRING": f"{LOGIN_USER}:{read}",
    }


def log_in(run_dir: Path) -> None:
    """Give this process the stack's login unless its environment names one already (a user's own server)."""
    for name, value in client_env(run_dir).items():
        os.environ.setdefault(name, value)


def secret_values(run_dir: Path) -> list[str]:
    """Every password this workdir's stack generated: what a log or an error must never show."""
    folder = credentials_dir(run_dir)
    return [p.read_text().strip() for p in sorted(folder.glob("*.password"))] if folder.is_dir() else []

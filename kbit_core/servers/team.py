"""The servers a team profile adds under the local stack (``stack.database``, ``stack.artifacts``, ``stack.auth``):
PostgreSQL with kbit's databases migrated and s3proxy, in start order, and the settings that point the Prefect and
MLflow servers at them and put both behind kbit's login."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kbit_core.config import KbitConfig
from kbit_core.errors import KbitError
from kbit_core.servers import logins, postgres
from kbit_core.servers.object_store import ARTIFACT_BUCKET, object_store, s3_client_env
from kbit_core.service import Service, ServiceStatus

__all__ = ["TeamServers"]


class TeamServers:
    """What a team profile runs beside the Prefect and MLflow servers; nothing at all for the embedded default."""

    def __init__(self, cfg: KbitConfig, error_type: type[KbitError]) -> None:
        self.cfg, self.run_dir, self.error_type = cfg, cfg.run_dir, error_type
        st = cfg.stack
        self.postgres = (
            postgres.postgres_server(self.run_dir, st.host, st.postgres_port, error_type)
            if st.database == "postgresql"
            else None
        )
        self.s3proxy = object_store(self.run_dir, st.host, st.s3_port, error_type) if st.artifacts == "s3" else None
        if st.auth:
            logins.password(self.run_dir, "login")  # before any server or client reads it, so all take the same

    @property
    def services(self) -> list[Service]:
        return [svc for svc in (self.postgres, self.s3proxy) if svc is not None]

    def start(self) -> None:
        """PostgreSQL (its users and databases ensured, MLflow's schema migrated) and s3proxy, unless running."""
        if self.postgres is not None:
            self.postgres.start()
            st = self.cfg.stack
            postgres.ensure_databases(self.run_dir, st.host, st.postgres_port)
            if postgres.has_tables(self.run_dir, st.host, st.postgres_port, "mlflow"):
                self._upgrade_mlflow()
        if self.s3proxy is not None:
            self.s3proxy.start()

    def _upgrade_mlflow(self) -> None:
        """`mlflow db upgrade` on an existing store (a new one gets the current schema from the server itself)."""
        url = self.database_url("mlflow")
        proc = subprocess.run(
            [sys.executable, "-m", "mlflow", "db", "upgrade", url],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **self.pg_env()},
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise self.error_type(f"`mlflow db upgrade {url}` failed (exit {proc.returncode}): {last}")

    def stop(self) -> list[str]:
        """Stop s3proxy, then PostgreSQL (its clients are down by now); the names that were running."""
        return [svc.name for svc in reversed(self.services) if svc.stop()]

    def status(self) -> list[ServiceStatus]:
        return [svc.status() for svc in self.services]

    def database_url(self, database: str, driver: str = "") -> str:
        st = self.cfg.stack
        return postgres.database_url(self.run_dir, st.host, st.postgres_port, database, driver)

    def pg_env(self) -> dict[str, str]:
        """Where libpq and asyncpg find kbit's database passwords."""
        if self.postgres is None:
            return {}
        return {"PGPASSFILE": str(logins.pgpass(self.run_dir, self.cfg.stack.host, self.cfg.stack.postgres_port))}

    def login_secret(self) -> str | None:
        return logins.password(self.run_dir, "login") if self.cfg.stack.auth else None

    def prefect_server_env(self) -> dict[str, str]:
        """Prefect's server on kbit's database (its migrations run on start) and behind kbit's login."""
        env = self.pg_env()
        if self.postgres is not None:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database_url("prefect", "asyncpg")
        secret = self.login_secret()
        if secret is not None:
            env["PREFECT_SERVER_API_AUTH_STRING"] = f"{logins.LOGIN_USER}:{secret}"
        return env

    def mlflow_stores(self, default_store: str, default_artifacts: str) -> list[str]:
        """MLflow server arguments: backend store and artifacts destination, and its basic-auth app with ``auth``."""
        store = self.database_url("mlflow") if self.postgres is not None else default_store
        artifacts = f"s3://{ARTIFACT_BUCKET}" if self.s3proxy is not None else default_artifacts
        app = ["--app-name", "basic-auth"] if self.cfg.stack.auth else []
        return ["--backend-store-uri", store, "--artifacts-destination", artifacts, *app]

    def mlflow_server_env(self) -> dict[str, str]:
        """The MLflow server's database passwords, S3 keys, and its auth app's config and first admin (kbit's login)."""
        st = self.cfg.stack
        env = self.pg_env()
        if self.s3proxy is not None:
            env.update(s3_client_env(self.run_dir, st.host, st.s3_port))
        secret = self.login_secret()
        if secret is not None:
            env.update(
                MLFLOW_AUTH_CONFIG_PATH=str(self._auth_config()),
                MLFLOW_AUTH_ADMIN_USERNAME=logins.LOGIN_USER,
                MLFLOW_AUTH_ADMIN_PASSWORD=secret,
                # signs the UI's CSRF tokens; the auth app refuses to start without a fixed one
                MLFLOW_FLASK_SERVER_SECRET_KEY=logins.password(self.run_dir, "mlflow-csrf"),
            )
        return env

    def _auth_config(self) -> Path:
        """MLflow's basic-auth config: its users in kbit's database (or SQLite), no password in the file."""
        if self.postgres is not None:
            users = self.database_url("mlflow_auth")
        else:
            users = f"sqlite:///{logins.state_dir(self.run_dir) / 'mlflow-auth.db'}"
        text = (
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = {users}\n"
            f"admin_username = {logins.LOGIN_USER}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        return logins.write_private(logins.credentials_dir(self.run_dir) / "mlflow-auth.ini", text)

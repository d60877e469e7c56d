"""kbit's own PostgreSQL server for a team profile: one cluster under ``<workdir>/state/postgres``, bound to the
stack's host, with a database for Prefect (and ``pg_trgm``, which Prefect 3 needs) and two for MLflow (runs and
its basic-auth users), each owned by a user of kbit's with a generated password (:mod:`kbit_core.servers.logins`)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg2
from psycopg2 import sql

from kbit_core.errors import KbitError
from kbit_core.servers import logins
from kbit_core.service import Service

__all__ = ["DATABASES", "PostgresError", "database_url", "ensure_databases", "postgres_server"]

# database -> the kbit user that owns it
DATABASES = {"prefect": logins.PREFECT_DB_USER, "mlflow": logins.MLFLOW_DB_USER, "mlflow_auth": logins.MLFLOW_DB_USER}
PG_ROOT = Path("/usr/lib/postgresql")
# PostgreSQL refuses to run as root; as root kbit runs it as this system user (Debian's postgresql packages add it).
SYSTEM_USER = "postgres"


class PostgresError(KbitError):
    """kbit's PostgreSQL server cannot be found, initialised, started or set up."""


def find_bindir() -> Path:
    """PostgreSQL's programs: $KBIT_POSTGRES_BIN, else the newest /usr/lib/postgresql/<version>/bin."""
    named = os.environ.get("KBIT_POSTGRES_BIN")
    found = [Path(named)] if named else sorted(PG_ROOT.glob("*/bin"), key=_major, reverse=True)
    for bindir in found:
        if (bindir / "postgres").is_file() and (bindir / "initdb").is_file():
            return bindir
    where = f"KBIT_POSTGRES_BIN={named}" if named else f"{PG_ROOT}/*/bin"
    raise PostgresError(
        f"stack.database=postgresql needs PostgreSQL 14.9+ (postgres, initdb) at {where}: "
        "install e.g. postgresql-15 and postgresql-contrib"
    )


def _major(bindir: Path) -> int:
    version = bindir.parent.name
    return int(version) if version.isdigit() else 0


def data_dir(run_dir: Path) -> Path:
    return logins.state_dir(run_dir) / "postgres" / "data"


def _as_server_user(argv: list[str]) -> list[str]:
    """``argv`` as the user PostgreSQL runs as: this one, or (as root) the ``postgres`` system user."""
    if os.geteuid() != 0:
        return argv
    return ["setpriv", f"--reuid={SYSTEM_USER}", f"--regid={SYSTEM_USER}", "--init-groups", "--", *argv]


def _hand_over(path: Path) -> None:
    """As root, give ``path`` to the server's user (it refuses a data directory it does not own)."""
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam(SYSTEM_USER)
        except KeyError:
            raise PostgresError(
                f"PostgreSQL refuses to run as root and there is no {SYSTEM_USER!r} user to run it as: "
                "run kbit as another user, or add the system user (the postgresql package does)"
            ) from None
        os.chown(path, user.pw_uid, user.pw_gid)


def initialise(run_dir: Path, host: str) -> Path:
    """``initdb`` once: the superuser is kbit's admin with its generated password, every login needs a password."""
    data = data_dir(run_dir)
    if (data / "PG_VERSION").is_file():
        return data
    try:
        data.mkdir(parents=True, exist_ok=True)
        os.chmod(data, 0o700)
        _hand_over(data)
        # the server's user reads the superuser's password from a file of its own, removed right after
        pwfile = logins.write_private(data.parent / "initdb.pw", logins.password(run_dir, logins.POSTGRES_ADMIN))
        _hand_over(pwfile)
    except OSError as exc:
        raise PostgresError(
            f"cannot create PostgreSQL's data directory {data}: {exc.strerror} ({exc.filename})"
        ) from None
    argv = [
        str(find_bindir() / "initdb"),
        "-D",
        str(data),
        "-U",
        logins.POSTGRES_ADMIN,
        f"--pwfile={pwfile}",
        "--auth=scram-sha-256",
        "--encoding=UTF8",
        "--locale=C",
        "--no-instructions",
    ]
    try:
        proc = subprocess.run(_as_server_user(argv), capture_output=True, text=True, timeout=300)
    finally:
        pwfile.unlink(missing_ok=True)
    if proc.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        hint = f" (as root it runs as {SYSTEM_USER!r}, who must be able to enter {data})" if os.geteuid() == 0 else ""
        raise PostgresError(f"initdb {data} failed (exit {proc.returncode}){hint}: {_first_line(proc.stderr)[-2000:]}")
    if host not in ("127.0.0.1", "localhost"):
        # initdb trusts only loopback; the servers on a bed's driver host connect from its own address
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {host}/32 scram-sha-256\n")
    return data


def postgres_server(run_dir: Path, host: str, port: int, error_type: type[KbitError] = PostgresError) -> Service:
    """The PostgreSQL server as a :class:`Service`, initialised on its first start; TCP only (no Unix socket)."""
    data = data_dir(run_dir)
    argv = [
        str(find_bindir() / "postgres"),
        "-D",
        str(data),
        "-c",
        f"listen_addresses={host}",
        "-p",
        str(port),
        "-c",
        "unix_socket_directories=",
        "-c",
        "shared_buffers=32MB",
        "-c",
        "max_connections=100",
    ]
    return Service(
        "postgres",
        run_dir,
        _as_server_user(argv),
        marker=str(data),
        host=host,
        port=port,
        url=f"postgresql://{host}:{port}",
        port_setting="stack.postgres_port",
        error_type=error_type,
        prepare=lambda: initialise(run_dir, host),
        # a fast shutdown (pg_ctl's default): SIGTERM's smart one waits for every client, e.g. the pooled connections
        # of a Prefect or MLflow server still up, and SIGKILL would follow
        stop_signal=signal.SIGINT,
    )


def database_url(run_dir: Path, host: str, port: int, database: str, driver: str = "") -> str:
    """The URL of one of kbit's databases, without its password (libpq and asyncpg read it from PGPASSFILE)."""
    scheme = f"postgresql+{driver}" if driver else "postgresql"
    return f"{scheme}://{DATABASES[database]}@{host}:{port}/{database}"


# What PostgreSQL answers while it replays its log after a start: its port accepts before it takes logins.
STARTING_UP = ("the database system is starting up", "the database system is not yet accepting connections")


def _connect(
    run_dir: Path, host: str, port: int, database: str = "postgres", wait_s: float = 120.0
) -> psycopg2.extensions.connection:
    """A connection as kbit's admin, waiting up to ``wait_s`` while the server is still starting up."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = psycopg2.connect(
                host=host,
                port=port,
                dbname=database,
                user=logins.POSTGRES_ADMIN,
                password=logins.password(run_dir, logins.POSTGRES_ADMIN),
                connect_timeout=30,
            )
        except psycopg2.Error as exc:
            if any(text in str(exc) for text in STARTING_UP) and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise PostgresError(
                f"cannot connect to kbit's PostgreSQL at {host}:{port} as {logins.POSTGRES_ADMIN}: {_first_line(exc)}"
            ) from None
        conn.autocommit = True
        return conn


def _first_line(exc: Exception) -> str:
    return re.sub(r"\s+", " ", str(exc)).strip()


def ensure_databases(run_dir: Path, host: str, port: int) -> None:
    """kbit's users (their passwords as generated), their databases, and pg_trgm in Prefect's: idempotent."""
    conn = _connect(run_dir, host, port)
    try:
        with conn.cursor() as cur:
            for user in sorted(set(DATABASES.values())):
                cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,))
                verb = "ALTER" if cur.fetchone() else "CREATE"
                cur.execute(
                    sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(user)),
                    (logins.password(run_dir, user),),
                )
            for database, owner in DATABASES.items():
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
                if cur.fetchone() is None:
                    cur.execute(
                        sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(owner))
                    )
    finally:
        conn.close()
    conn = _connect(run_dir, host, port, "prefect")
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    finally:
        conn.close()


def has_tables(run_dir: Path, host: str, port: int, database: str) -> bool:
    """Whether ``database`` holds a schema already (``mlflow db upgrade`` migrates one; the server creates a new one)."""
    conn = _connect(run_dir, host, port, database)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass('public.alembic_version') IS NOT NULL")
            return bool(cur.fetchone()[0])
    finally:
        conn.close()

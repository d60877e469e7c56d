"""The local stack: embedded broker, Prefect server, process worker and MLflow server, each with a PID and log."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.errors import KbitError
from kbit_core.kafka.broker import EmbeddedBroker, port_open

log = logging.getLogger(__name__)

# The checkout holding prefect.yaml, flows/ and tasks/: the process worker runs flows from here.
PROJECT_ROOT = Path(__file__).resolve().parents[1]

# How often the worker asks the server for runs; Prefect's default of 10 s dominates a smoke run.
WORKER_QUERY_SECONDS = "2"

SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


class StackError(KbitError):
    """A stack service cannot start, is unhealthy, its port is taken, or a deployment is wrong."""


def _pid_alive(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``url`` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _api(method: str, url: str, body: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Any:
    """One JSON call to a Prefect REST endpoint; None on 404."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise StackError(f"{method} {url} answered {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StackError(f"{method} {url} failed: {exc}") from None


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    running: bool
    pid: int | None
    url: str | None
    log_path: Path | None


@dataclass
class Service:
    """One long-running process started in its own session, so that stopping its process group stops it all.

    ``marker`` must appear in the process command line: a PID file left behind by a crash and
    reused by an unrelated process is then never mistaken for ours.
    """

    name: str
    run_dir: Path
    argv: list[str]
    marker: str
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None
    port: int | None = None
    health_url: str | None = None
    url: str | None = None

    @property
    def pid_path(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) and self.marker in _cmdline(pid) else None

    def healthy(self) -> bool:
        return self.health_url is None or http_ok(self.health_url)

    def status(self) -> ServiceStatus:
        pid = self.pid()
        return ServiceStatus(self.name, pid is not None and self.healthy(), pid, self.url, self.log_path)

    def start(self, timeout_s: float = 90.0) -> ServiceStatus:
        """Start unless ours already runs; wait until healthy. A port held by anything else is an error."""
        if self.pid() is not None:
            self._wait_healthy(timeout_s)
            return self.status()
        if self.port is not None and port_open(self.host or "127.0.0.1", self.port):
            raise StackError(
                f"{self.name}: port {self.host}:{self.port} is already taken by another process; "
                f"stop it or choose another port (stack.prefect_port / stack.mlflow_port)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **self.env}, start_new_session=True)
        self.pid_path.write_text(str(proc.pid))
        log.info("%s started (pid %d), log %s", self.name, proc.pid, self.log_path)
        self._wait_healthy(timeout_s, proc)
        return self.status()

    def _wait_healthy(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_path.unlink(missing_ok=True)
                raise StackError(f"{self.name} exited with code {proc.returncode} on start; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise StackError(f"{self.name} was not healthy at {self.health_url} within {timeout_s:.0f}s; "
                         f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> bool:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; True when ours was running."""
        pid = self.pid()
        self.pid_path.unlink(missing_ok=True)
        if pid is None:
            return False
        # start_new_session made the service a group leader: its children (uvicorn workers,
        # flow-run processes) share the group and go down with it.
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _pid_alive(pid):
            time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)
        _reap(pid)
        log.info("%s stopped (pid %d)", self.name, pid)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def _reap(pid: int) -> None:
    """Collect the exit status when the service is our own child, so no zombie outlives it here."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class LocalStack:
    """The services kbit needs on one machine, all bound to ``stack.host`` and kept under ``cfg.run_dir``.

    Prefect keeps its SQLite database under ``<run_dir>/prefect`` (PREFECT_HOME); MLflow keeps
    ``<run_dir>/mlflow.db`` and ``<run_dir>/mlartifacts``. A remote Prefect API
    (``stack.prefect_api_url``) replaces the local server; an external Kafka cluster
    (``kafka.bootstrap_servers``) replaces the embedded broker, and an http(s) ``tracking.tracking_uri``
    the local MLflow server.
    """

    def __init__(self, cfg: KbitConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        st = cfg.stack
        self.prefect_ui_url = f"http://{st.host}:{st.prefect_port}"
        self.prefect_api_url = st.prefect_api_url or f"{self.prefect_ui_url}/api"
        local_mlflow = f"http://{st.host}:{st.mlflow_port}"
        remote_uri = cfg.tracking.tracking_uri or ""
        # A profile tracking to a shared http(s) server needs no local one; sqlite profiles still get it.
        self.remote_mlflow = remote_uri.startswith(("http://", "https://")) and remote_uri.rstrip("/") != local_mlflow
        self.mlflow_url = remote_uri.rstrip("/") if self.remote_mlflow else local_mlflow
        self.broker = EmbeddedBroker(self.run_dir, cfg.kafka.embedded.host, cfg.kafka.embedded.port)
        self.prefect_server = Service(
            "prefect-server", self.run_dir,
            [sys.executable, "-m", "prefect", "server", "start", "--host", st.host, "--port", str(st.prefect_port)],
            marker="prefect", env=self.prefect_env(), host=st.host, port=st.prefect_port,
            health_url=f"{self.prefect_api_url}/health", url=self.prefect_ui_url,
        )
        self.mlflow_server = Service(
            "mlflow-server", self.run_dir,
            [sys.executable, "-m", "mlflow", "server", "--host", st.host, "--port", str(st.mlflow_port),
             "--backend-store-uri", f"sqlite:///{self.run_dir / 'mlflow.db'}",
             "--artifacts-destination", str(self.run_dir / "mlartifacts"), "--workers", "1"],
            marker="mlflow", env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, host=st.host,
            port=st.mlflow_port, health_url=f"{local_mlflow}/health", url=local_mlflow,
        )
        self.worker = Service(
            "prefect-worker", self.run_dir,
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", st.work_pool,
             "--name", self.worker_name, "--type", "process"],
            marker="prefect", env={**self.prefect_env(), "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS},
        )

    @property
    def worker_name(self) -> str:
        return f"kbit-{self.cfg.stack.work_pool}"

    @property
    def remote_prefect(self) -> bool:
        return self.cfg.stack.prefect_api_url is not None

    def prefect_env(self) -> dict[str, str]:
        """Environment for every Prefect process: isolated home, explicit API URL, no telemetry."""
        return {
            "PREFECT_HOME": str(self.run_dir / "prefect"),
            "PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
        }

    def deploy_env(self) -> dict[str, str]:
        """Variables prefect.yaml resolves at deploy time (a missing one would be stored as a literal template)."""
        return {
            **self.prefect_env(),
            "PIPELINE_ROOT": str(PROJECT_ROOT),
            "KBIT_WORK_POOL": self.cfg.stack.work_pool,
            "KBIT_MLFLOW_TRACKING_URI": self.mlflow_url,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def up(self, broker_only: bool = False) -> list[ServiceStatus]:
        """Start what is not running yet, create the work pool, deploy prefect.yaml, then start the worker."""
        if self.cfg.kafka.uses_embedded:
            self.broker.start()
        if broker_only:
            return self.status()
        if not self.remote_prefect:
            self.prefect_server.start()
        if not self.remote_mlflow:
            self.mlflow_server.start()
        self.ensure_work_pool()
        self.deploy()
        self.worker.start()
        self.wait_for_worker()
        return self.status()

    def down(self) -> list[str]:
        """Stop every service of ours by PID, worker first; returns the names that were running."""
        stopped = [svc.name for svc in (self.worker, self.mlflow_server, self.prefect_server) if svc.stop()]
        if self.broker.stop():
            stopped.append("broker")
        return stopped

    def status(self) -> list[ServiceStatus]:
        services = []
        if self.cfg.kafka.uses_embedded:
            b = self.broker.status()
            services.append(ServiceStatus("broker", b.running, b.pid, b.bootstrap, b.log_path))
        if self.remote_prefect:
            services.append(ServiceStatus("prefect-server (remote)", http_ok(f"{self.prefect_api_url}/health"),
                                          None, self.prefect_api_url, None))
        else:
            services.append(self.prefect_server.status())
        services.append(self.worker.status())
        if self.remote_mlflow:
            services.append(ServiceStatus("mlflow-server (remote)", http_ok(f"{self.mlflow_url}/health"), None,
                                          self.mlflow_url, None))
        else:
            services.append(self.mlflow_server.status())
        return services

    # -- Prefect objects -------------------------------------------------------------------------

    def prefect_cli(self, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> str:
        """Run the Prefect CLI against this stack's API; a non-zero exit becomes a StackError with its output."""
        proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=timeout_s, env={**os.environ, **(env or self.prefect_env())},
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise StackError(f"`prefect {' '.join(args)}` failed with exit code {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc.stdout

    def ensure_work_pool(self) -> None:
        pool = self.cfg.stack.work_pool
        if _api("GET", f"{self.prefect_api_url}/work_pools/{pool}") is None:
            self.prefect_cli("work-pool", "create", pool, "--type", "process")

    def deploy(self) -> list[dict[str, Any]]:
        """`prefect --no-prompt deploy --all` from the checkout, then check what was stored."""
        self.prefect_cli("--no-prompt", "deploy", "--all", env=self.deploy_env())
        return self.verify_deployments()

    def deployments(self) -> list[dict[str, Any]]:
        return _api("POST", f"{self.prefect_api_url}/deployments/filter", {"limit": 200}) or []

    def verify_deployments(self) -> list[dict[str, Any]]:
        """Fail unless every deployment runs from an existing absolute directory with resolved templates.

        Prefect stores ``{{ $PIPELINE_ROOT }}`` literally when the variable is missing at deploy time;
        the flow run would only crash later, inside a temporary directory, on the worker.
        """
        deployments = self.deployments()
        if not deployments:
            raise StackError(f"no deployments found at {self.prefect_api_url} after deploying {PROJECT_ROOT}")
        for dep in deployments:
            where = f"deployment {dep['name']!r} (entrypoint {dep.get('entrypoint')})"
            dirs = [step[SET_WORKING_DIRECTORY]["directory"]
                    for step in dep.get("pull_steps") or [] if SET_WORKING_DIRECTORY in step]
            if not dirs:
                raise StackError(f"{where} has no set_working_directory pull step")
            for directory in dirs:
                if not Path(directory).is_absolute() or not Path(directory).is_dir():
                    raise StackError(f"{where}: pull step directory {directory!r} is not an existing absolute path")
            stored = json.dumps([dep.get("pull_steps"), dep.get("job_variables"), dep.get("work_pool_name")])
            if "{{" in stored:
                raise StackError(f"{where} stored an unresolved template: {stored}")
        return deployments

    def wait_for_worker(self, timeout_s: float = 60.0) -> None:
        """Wait until the worker has registered with its pool (it polls only after that)."""
        url = f"{self.prefect_api_url}/work_pools/{self.cfg.stack.work_pool}/workers/filter"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.worker.pid() is None:
                raise StackError(f"prefect-worker exited; log {self.worker.log_path}:\n{self.worker.log_tail()}")
            if any(w["name"] == self.worker_name for w in _api("POST", url, {}) or []):
                return
            time.sleep(0.5)
        raise StackError(f"prefect-worker did not register with pool {self.cfg.stack.work_pool!r} within "
                         f"{timeout_s:.0f}s; log {self.worker.log_path}:\n{self.worker.log_tail()}")

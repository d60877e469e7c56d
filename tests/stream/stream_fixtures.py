"""Helpers of the stream tests: a stream config on a test's own broker, and a broker crash."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.kafka.broker import EmbeddedBroker, port_open
from tests.conftest import embedded_settings, free_port


def stream_config(tmp_path: Path, broker: EmbeddedBroker, overrides: dict[str, Any] | None = None) -> KbitConfig:
    """A 3-partition raw stream of 50 cycled records on ``broker``, tracking off; ``overrides`` nested."""
    base = {
        "workdir": str(tmp_path / "kbit"),
        "kafka": {"embedded": embedded_settings(broker)},
        "dataset": {"num_records": 50},
        "tracking": {"enabled": False},
        "produce": {"partitions": 3, "variant": {"format": "raw", "layout": "bytes", "compression": "lz4"}},
        "stream": {"topic": f"stream-{free_port()}"},
    }
    return KbitConfig.from_dict(deep_merge(base, overrides or {}))


def freeze(broker: EmbeddedBroker) -> None:
    """SIGSTOP the broker: what clients send from now on is in flight, sent but unanswered, until it goes on or
    ``crash_and_restart`` kills it."""
    os.kill(broker.status().pid, signal.SIGSTOP)


def crash_and_restart(broker: EmbeddedBroker) -> None:
    """SIGKILL the broker (a graceful stop waits for its clients) and start an empty one on the same port."""
    os.kill(broker.status().pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (broker.status().running or port_open(broker.host, broker.port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    broker.start()

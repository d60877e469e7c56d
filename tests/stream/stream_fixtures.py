"""Helpers of the stream tests: a stream config on a test's own broker, and a broker crash."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kbit_core.brokers.broker import EmbeddedBroker, port_open
from kbit_core.config import KbitConfig, deep_merge
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


ESTABLISHED = "01"  # the TCP state as /proc/net/tcp writes it


def bytes_waiting_at(port: int) -> int:
    """Bytes the kernel holds unread in the receive queues of the connections accepted on ``port`` (/proc/net/tcp*):
    what clients sent to a frozen broker and it has not read."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state, queues = row.split()[1], row.split()[3], row.split()[4]
                if int(local.rsplit(":", 1)[1], 16) == port and state == ESTABLISHED:
                    waiting += int(queues.split(":")[1], 16)
    return waiting


def wait_until_in_flight(broker: EmbeddedBroker, timeout_s: float = 15) -> None:
    """Block until a client's request reached the frozen ``broker``'s socket: a fixed sleep is not enough on a
    loaded machine, where a client that had not sent yet meets the restarted broker with a fresh request instead."""
    deadline = time.monotonic() + timeout_s
    while bytes_waiting_at(broker.port) == 0:
        assert time.monotonic() < deadline, (
            f"no request reached the frozen broker on port {broker.port} in {timeout_s}s"
        )
        time.sleep(0.02)


def crash_and_restart(broker: EmbeddedBroker) -> None:
    """SIGKILL the broker (a graceful stop waits for its clients) and start an empty one on the same port."""
    os.kill(broker.status().pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (broker.status().running or port_open(broker.host, broker.port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    broker.start()

"""The embedded Tansu broker's lifecycle: start on loopback, reuse, refuse a foreign port, stop by PID."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from kbit_core.brokers.broker import EmbeddedBroker, port_open
from kbit_core.brokers.local import embedded_broker
from kbit_core.errors import BrokerError
from tests.conftest import free_port

pytestmark = pytest.mark.kafka


def test_start_status_reuse_and_stop_leave_no_process(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, port=free_port())
    status = broker.start()
    assert status.running and status.host == "127.0.0.1" and port_open("127.0.0.1", broker.port)
    assert broker.start().pid == status.pid  # a second start reuses the running broker
    assert (tmp_path / "broker.pid").read_text() == str(status.pid)
    assert broker.stop()
    assert not broker.status().running and not (tmp_path / "broker.pid").exists()
    ps = subprocess.run(["ps", "-o", "stat=", "-p", str(status.pid)], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"broker pid {status.pid} still listed (zombie?): {ps.stdout!r}"
    assert not broker.stop()  # nothing left to stop


def test_port_taken_by_another_process_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(BrokerError, match=f"127.0.0.1:{port} is already taken"):
            EmbeddedBroker(tmp_path, port=port).start()


def test_stale_pid_file_never_stops_a_stranger(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "broker.pid").write_text(str(stranger.pid))
        broker = EmbeddedBroker(tmp_path, port=free_port())
        assert not broker.status().running
        assert not broker.stop()
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_embedded_broker_block_starts_and_stops_only_its_own(tmp_path: Path, make_config, broker) -> None:
    # a free controller port of its own too: the default, port + 1, may be any process's ephemeral port (it was once)
    ports = {"port": free_port(), "controller_port": free_port()}
    own = make_config(workdir=str(tmp_path / "own"), kafka={"embedded": ports})
    with embedded_broker(own):
        assert port_open("127.0.0.1", own.kafka.embedded.port)
    assert not port_open("127.0.0.1", own.kafka.embedded.port)
    shared = make_config()  # the session broker already listens there: used, and left running
    with embedded_broker(shared):
        pass
    assert port_open("127.0.0.1", broker.port)

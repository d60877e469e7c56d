"""The local stack's services: start, report, reuse, refuse a taken port, and stop by PID (one SIGTERM)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.config import KbitConfig
from kbit_core.service import http_ok, pid_alive, start_together
from kbit_core.stack import LocalStack, StackError
from tests.conftest import free_port

pytestmark = pytest.mark.prefect


def stack_config(workdir: Path) -> KbitConfig:
    return KbitConfig.from_dict(
        {
            "workdir": str(workdir),
            "kafka": {"embedded": {"port": free_port(), "controller_port": free_port()}},
            "stack": {"prefect_port": free_port(), "mlflow_port": free_port(), "work_pool": "kbit-test-pool"},
        }
    )


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def wait_gone(pid: int, timeout_s: float) -> bool:
    return wait_until(lambda: not pid_alive(pid), timeout_s)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    s = LocalStack(stack_config(tmp_path / "kbit"))
    yield s
    s.down()


def test_port_taken_by_another_process_is_a_clear_error(stack: LocalStack) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", stack.cfg.stack.mlflow_port))
        squatter.listen()
        with pytest.raises(
            StackError,
            match=rf"mlflow-server: port 127.0.0.1:{stack.cfg.stack.mlflow_port} "
            r"is already taken",
        ):
            stack.mlflow_server.start()
    assert not stack.mlflow_server.pid_path.exists()


def test_stale_pid_file_of_an_unrelated_process_is_neither_ours_nor_killed(stack: LocalStack) -> None:
    unrelated = subprocess.Popen(["sleep", "30"])
    try:
        stack.run_dir.mkdir(parents=True)
        stack.mlflow_server.pid_path.write_text(str(unrelated.pid))
        assert stack.mlflow_server.status().running is False
        assert stack.mlflow_server.stop() is False
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


@pytest.mark.slow
def test_services_start_report_reuse_and_stop(stack: LocalStack) -> None:
    stack.broker.start()
    start_together([stack.prefect_server, stack.mlflow_server])  # as `up` starts them
    stack.ensure_work_pool()
    stack.worker.start()
    stack.wait_for_worker()

    services = {s.name: s for s in stack.status()}
    assert all(s.running for s in services.values()), services
    assert services["prefect-server"].url == f"http://127.0.0.1:{stack.cfg.stack.prefect_port}"
    assert http_ok(f"{stack.prefect_api_url}/health") and http_ok(f"{stack.mlflow_url}/health")
    for name in ("prefect-server", "prefect-worker", "mlflow-server"):
        assert (stack.run_dir / f"{name}.pid").read_text() == str(services[name].pid)
        # polled: the worker registers with the server before it prints its first line (a loaded run of the whole
        # suite found its log still empty here)
        log = stack.run_dir / f"{name}.log"
        assert wait_until(lambda log=log: log.stat().st_size > 0, 30.0), f"{log} stayed empty"
    assert (stack.run_dir / "prefect" / "prefect.db").is_file()  # PREFECT_HOME is inside the run dir
    assert (stack.run_dir / "mlflow.db").is_file()

    # Starting again reuses what runs instead of starting a second copy.
    assert stack.prefect_server.start().pid == services["prefect-server"].pid

    # The worker runs in its own process group: one SIGTERM to the group stops it (the pitfall of
    # a backgrounded worker that ignores SIGINT and keeps picking up runs).
    worker_pid = services["prefect-worker"].pid
    os.killpg(worker_pid, signal.SIGTERM)
    assert wait_gone(worker_pid, 10.0), "the worker survived one SIGTERM"

    result = CliRunner().invoke(
        app,
        [
            "stack",
            "status",
            "--set",
            f"workdir={stack.run_dir}",
            "--set",
            f"stack.prefect_port={stack.cfg.stack.prefect_port}",
            "--set",
            f"stack.mlflow_port={stack.cfg.stack.mlflow_port}",
            "--set",
            f"kafka.embedded.port={stack.cfg.kafka.embedded.port}",
            "--set",
            "stack.work_pool=kbit-test-pool",
        ],
    )
    assert result.exit_code == 1, result.output  # the worker is down
    assert "prefect-worker" in result.output and "stopped" in result.output

    stopped = stack.down()
    assert set(stopped) == {"prefect-server", "mlflow-server", "broker"}
    for name in ("prefect-server", "mlflow-server"):
        assert wait_gone(services[name].pid, 5.0)
    assert not any(s.running for s in stack.status())
    assert not http_ok(f"{stack.prefect_api_url}/health")

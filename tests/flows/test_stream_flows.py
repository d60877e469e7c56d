"""Flows `produce_stream` and `train_stream` on the real broker: what the live producer appended, the
continuous training's lag/freshness artifact, and a cancelled `train_stream` run stopping its ranks cleanly."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import State

from flows.stream import produce_stream, train_stream
from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import deep_merge
from kbit_core.jobs.train import train
from kbit_core.stack import PROJECT_ROOT
from kbit_core.stream.ledger import audit
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.stream_log import StreamLog, stream_log_path
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.stream_trainer import stop_file_path
from tasks.config import load_run_config
from tests.conftest import Background
from tests.flows.helpers import delete_topics, flow_overrides, topic_prefix

pytestmark = pytest.mark.kafka

STEP_REPORT = re.compile(r"^step \d+: \d+ records", re.MULTILINE)  # a stream report line (stream_trainer._report)


@pytest.fixture(autouse=True)
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def stream_overrides(broker: EmbeddedBroker, tmp_path: Path, **stream: object) -> dict[str, object]:
    return flow_overrides(
        broker,
        tmp_path,
        {
            "stream": {"topic": f"{topic_prefix(tmp_path)}.stream", "rate": 2000, **stream},
            "train": {"model": {"name": "mlp"}, "global_batch_size": 32},
            "checkpoint": {"dir": None},
            "tracking": {"enabled": False},
        },
    )


def test_produce_stream_appends_and_a_second_run_continues(broker: EmbeddedBroker, tmp_path: Path) -> None:
    first = produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=40))
    second = produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=100))
    assert (first["produced"], second["produced"], second["next_index"]) == (40, 60, 100)
    assert StreamLog.load(Path(second["manifest_path"])).runs() == {0: [[0, 98]], 1: [[1, 99]]}


@pytest.mark.spark
@pytest.mark.slow
def test_train_stream_publishes_lag_and_freshness(broker: EmbeddedBroker, tmp_path: Path) -> None:
    produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=320))
    summary = train_stream(
        profile="train-stream",
        overrides=stream_overrides(broker, tmp_path, stop_after_records=320, eval_records=100, eval_every_steps=5),
    )
    assert summary["stop_reason"] == "records" and summary["lag_records"] == 0
    assert summary["freshness_s"]["p50"] > 0 and summary["metrics"]["records"] == 320
    with get_client(sync_client=True) as client:
        (artifact,) = [a for a in client.read_artifacts() if a.key == "kbit-stream-training"][-1:]
    assert "**320 records in" in artifact.data and "| step | records |" in artifact.data


@pytest.fixture
def process_worker(tmp_path: Path) -> Iterator[str]:
    """A Prefect process worker (as `kbit stack up` runs) on a work pool of its own; the pool's name."""
    pool = f"kbit-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    with (tmp_path / "worker.log").open("w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        with get_client(sync_client=True) as client:  # the worker creates its pool
            wait_for(lambda: _pool_exists(client, pool), 60, f"work pool {pool}")
        yield pool
    finally:
        # `prefect worker start` passes SIGTERM on to the worker it runs as SIGINT; on a loaded machine that worker
        # took over 30 s to end after a cancelled run (3 runs of 3 here): what the test checks is over by then
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)


def _pool_exists(client: SyncPrefectClient, pool: str) -> bool:
    try:
        client.read_work_pool(pool)
    except ObjectNotFound:
        return False
    return True


def rank_processes(workdir: Path) -> list[psutil.Process]:
    """Processes running a rank of a run in ``workdir`` (TorchDistributor's train.py is written under it)."""
    ranks = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(workdir) in cmdline and "train.py" in cmdline:
            ranks.append(process)
    return ranks


def stuck_report(processes: list[psutil.Process]) -> str:
    """Each process's state and its threads' native stacks (gdb), to tell where a process that should have exited
    waits."""
    lines = []
    for process in processes:
        try:
            with process.oneshot():
                lines.append(
                    f"pid {process.pid} ppid {process.ppid()} {process.status()} {process.cpu_times()} "
                    f"threads {process.num_threads()}: {' '.join(process.cmdline())}"
                )
        except psutil.Error as exc:
            lines.append(f"pid {process.pid}: {exc!r}")
            continue
        if shutil.which("gdb"):
            try:
                gdb = subprocess.run(
                    ["gdb", "-p", str(process.pid), "-batch", "-ex", "thread apply all bt 25"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                lines.append("gdb: no answer within 60 s")
            else:
                lines.append(gdb.stdout[-12000:] + gdb.stderr[-2000:])
    return "\n".join(lines)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.mark.spark
@pytest.mark.slow
def test_a_cancelled_train_stream_run_stops_its_ranks_with_a_final_checkpoint_that_a_rerun_continues(
    broker: EmbeddedBroker, tmp_path: Path, process_worker: str
) -> None:
    """A `train_stream` flow run through a process worker (as the deployments run), cancelled through the API
    while its ranks train on a live stream."""
    # No periodic checkpoints: any checkpoint was written as the ranks stopped. A report every step: the first one
    # in the worker's log says the ranks train.
    overrides = deep_merge(
        stream_overrides(
            broker, tmp_path, eval_records=100, eval_every_steps=1000, idle_timeout_s=120, report_every_steps=1
        ),
        {"checkpoint": {"dir": "ckpt", "every_steps": None}},
    )
    cfg = load_run_config("train-stream", overrides)
    lineage_dir = cfg.run_dir / "ckpt"
    stop_producing = threading.Event()
    producer = Background(LiveProducer(cfg).run, rate=100, duration_s=600, should_stop=stop_producing.is_set)
    try:
        with get_client(sync_client=True) as client:
            deployment = client.create_deployment(
                flow_id=client.create_flow_from_name("train_stream"),
                name=f"cancel-{uuid.uuid4().hex[:8]}",
                entrypoint="flows/stream.py:train_stream",
                work_pool_name=process_worker,
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT_ROOT)}}],
            )
            flow_run = client.create_flow_run_from_deployment(
                deployment, parameters={"profile": "train-stream", "overrides": overrides}
            )
            # rank 0 opens its lineage as it starts, and reports each step it trains
            wait_for(lambda: list(lineage_dir.glob("*/lineage.json")), 240, "checkpoint lineage")
            wait_for(lambda: STEP_REPORT.search((tmp_path / "worker.log").read_text()), 240, "first training step")
            client.set_flow_run_state(flow_run.id, State(type=StateType.CANCELLING))
            final_states = {StateType.CANCELLED, StateType.COMPLETED, StateType.FAILED, StateType.CRASHED}
            wait_for(lambda: client.read_flow_run(flow_run.id).state_type in final_states, 180, "final flow-run state")
            state = client.read_flow_run(flow_run.id).state
    finally:
        stop_producing.set()
        producer.result(60)
    worker_log = (tmp_path / "worker.log").read_text()
    assert state.type == StateType.CANCELLED, worker_log[-6000:]
    # torchrun starts the ranks in sessions of their own: the worker's group kill leaves them to finish their
    # final checkpoint and exit by themselves, which they must (not wait on their killed agent)
    try:
        wait_for(lambda: not rank_processes(cfg.workdir), 60, "exit of the cancelled run's ranks")
    except TimeoutError as exc:
        stop_file = stop_file_path(cfg)
        try:
            report = (
                f"{exc}; stop file {stop_file} {'exists' if stop_file.exists() else 'missing'}\n"
                f"{stuck_report(rank_processes(cfg.workdir))}\nworker log:\n{worker_log[-4000:]}"
            )
        finally:
            for rank in rank_processes(cfg.workdir):
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
        raise AssertionError(report) from None
    # The cancellation reached the driver as an exception (the worker SIGTERMs the flow run's process group): it
    # dropped the stop file for the ranks before re-raising.
    assert stop_file_path(cfg).read_text() == "the driver was interrupted\n"

    (lineage,) = ckpt.list_lineages(lineage_dir)
    (final,) = ckpt.list_checkpoints(lineage)
    stopped = ckpt.read_file(final)[ckpt.TRAIN_STATE]
    assert stopped["records"] > 0 and len(stopped["offsets"]) == cfg.produce.partitions and all(stopped["offsets"])
    assert sum(stopped["offsets"]) == stopped["records"]  # every partition's next offset, none ahead or behind

    produced = StreamLog.load(stream_log_path(cfg.workdir, cfg.stream.topic))
    total = produced.next_index()
    # On one rank: with two, the last records may all sit on one rank's partitions, which never step alone
    resumed = train(cfg.override({"stream.stop_after_records": total, "launch.num_processes": 1}), progress=False)
    assert resumed["records"] - resumed["records_this_run"] == stopped["records"]  # continued where it stopped
    result = audit(dict(enumerate(resumed["trained"])), produced.runs(), produced.partitions)
    assert result.exactly_once and result.trained == total, result.summary()

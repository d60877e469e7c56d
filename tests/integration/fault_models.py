"""Models that inject one fault into a real training run, for the launcher's failure tests.

Workers import this module through ``train.model.name='fault_models:<factory>'`` (the tests put this
directory on PYTHONPATH). Each factory wraps the built-in CNN; the fault fires inside a training
forward pass on one rank, so it hits the real loop, loaders and checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient
from torch import Tensor, nn

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import ModelConfig
from kbit_core.train.models import build_model


class FaultAt(nn.Module):
    """The wrapped model, except that training forward call number ``at_call`` on ``rank`` runs ``fault``."""

    def __init__(self, inner: nn.Module, rank: int, at_call: int, fault: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self._armed = int(os.environ.get("RANK", "0")) == rank
        self._at_call, self._fault, self._calls = at_call, fault, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self._armed:
            self._calls += 1
            if self._calls == self._at_call:
                self._fault()
        return self.inner(x)


def _cnn(image_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return build_model(ModelConfig(name="cnn"), image_shape, num_classes)


def crash_once(*, image_shape: tuple[int, ...], num_classes: int, at_step: int, marker: str) -> nn.Module:
    """Rank 1 raises at training step ``at_step`` of the first attempt only (``marker`` records that it did)."""

    def fault() -> None:
        if Path(marker).exists():
            return
        Path(marker).write_text("fired")
        raise RuntimeError(f"injected fault at step {at_step}")

    return FaultAt(_cnn(image_shape, num_classes), rank=1, at_call=at_step, fault=fault)


def stop_broker(
    *, image_shape: tuple[int, ...], num_classes: int, at_step: int, broker_dir: str, port: int
) -> nn.Module:
    """Rank 0 stops the embedded broker (by its PID file in ``broker_dir``) at training step ``at_step``."""

    def fault() -> None:
        EmbeddedBroker(Path(broker_dir), port=port).stop()

    return FaultAt(_cnn(image_shape, num_classes), rank=0, at_call=at_step, fault=fault)


def kill_each_attempt(
    *, image_shape: tuple[int, ...], num_classes: int, at_step: int, marker_dir: str, times: int
) -> nn.Module:
    """Rank 1 SIGKILLs itself at training step ``at_step`` of each of the first ``times`` attempts: no Python
    error, no traceback file, only torchrun's record (``marker_dir`` counts the kills; ``times=0`` never kills)."""

    def fault() -> None:
        fired = sorted(Path(marker_dir).glob("kill-*"))
        if len(fired) >= times:
            return
        Path(marker_dir, f"kill-{len(fired) + 1}").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    return FaultAt(_cnn(image_shape, num_classes), rank=1, at_call=at_step, fault=fault)


def kill_executor_once(*, image_shape: tuple[int, ...], num_classes: int, at_step: int, marker: str) -> nn.Module:
    """Rank 1 SIGKILLs the Spark executor JVM it runs under at step ``at_step`` of the first attempt only: the
    host's executor is lost mid-epoch, as when a machine dies (``marker`` records that it fired)."""

    def fault() -> None:
        if Path(marker).exists():
            return
        executor = _ancestor_running("CoarseGrainedExecutorBackend")
        Path(marker).write_text(str(executor))
        os.kill(executor, signal.SIGKILL)

    return FaultAt(_cnn(image_shape, num_classes), rank=1, at_call=at_step, fault=fault)


def _ancestor_running(text: str) -> int:
    pid = os.getppid()
    while pid > 1:
        if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"no ancestor process runs {text}")


def kill_leader(
    *, image_shape: tuple[int, ...], num_classes: int, at_step: int, bootstrap: str, topic: str, run_dir: str
) -> nn.Module:
    """Rank 0 SIGKILLs the broker leading partition 0 of ``topic`` at training step ``at_step`` (a cluster of
    :class:`kbit_core.brokers.cluster.KafkaCluster` in ``run_dir``, nodes named ``kafka-<id>``); ``run_dir/killed``
    records the node id."""

    def fault() -> None:
        meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
        leader = meta.topics[topic].partitions[0].leader
        os.kill(int(Path(run_dir, f"kafka-{leader}.pid").read_text()), signal.SIGKILL)
        Path(run_dir, "killed").write_text(str(leader))

    return FaultAt(_cnn(image_shape, num_classes), rank=0, at_call=at_step, fault=fault)


OUTAGE_TABLE = "kbit_outage"


def drop_link_once(
    *, image_shape: tuple[int, ...], num_classes: int, at_step: int, seconds: float, marker: str
) -> nn.Module:
    """Rank 0 cuts its host's link at training step ``at_step`` of the first attempt only: every packet arriving at
    the namespace's eth0 is dropped (an nftables netdev table) for ``seconds``, then the link is back. Training goes
    on meanwhile; ``marker`` records when the link went down and came back (Unix seconds)."""

    def restore_after() -> None:
        down = time.time()
        time.sleep(seconds)
        subprocess.run(["nft", "delete", "table", "netdev", OUTAGE_TABLE], check=True, capture_output=True)
        Path(marker).write_text(f"{down} {time.time()}")

    def fault() -> None:
        if Path(marker).exists():
            return
        Path(marker).write_text("down")
        ruleset = (
            f"table netdev {OUTAGE_TABLE} {{\n"
            f'  chain ingress {{ type filter hook ingress device "eth0" priority -10; drop; }}\n}}\n'
        )
        subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, check=True, capture_output=True)
        threading.Thread(target=restore_after, name="link-outage").start()

    return FaultAt(_cnn(image_shape, num_classes), rank=0, at_call=at_step, fault=fault)


class StepClock(nn.Module):
    """The wrapped model; each training forward call appends its Unix time to ``clock_dir/rank-<RANK>``, after
    sleeping so that steps start at least ``step_s`` apart (a run stretched over a fault; the weights are the same)."""

    def __init__(self, inner: nn.Module, clock_dir: str, step_s: float) -> None:
        super().__init__()
        self.inner = inner
        self._clock = Path(clock_dir, f"rank-{os.environ.get('RANK', '0')}")
        self._step_s, self._last = step_s, 0.0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            time.sleep(max(0.0, self._last + self._step_s - time.monotonic()))
            self._last = time.monotonic()
            with open(self._clock, "a") as clock:
                clock.write(f"{time.time()}\n")
        return self.inner(x)


def step_clock(*, image_shape: tuple[int, ...], num_classes: int, clock_dir: str, step_s: float = 0.0) -> nn.Module:
    """The CNN, each rank's training steps timed from outside (tests/testbed/measure_faults.py fires an operator's
    fault on the bed at a step and measures the longest wait between two steps)."""
    return StepClock(_cnn(image_shape, num_classes), clock_dir, step_s)


class SignalInEvaluation(nn.Module):
    """The wrapped model, except that its first evaluation forward call sends this process SIGTERM."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._signalled = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.training and not self._signalled:
            self._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner(x)


def sigterm_in_first_evaluation(*, image_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Every rank gets SIGTERM in its first evaluation: in a stream run that evaluates only at its end, after the
    ranks agreed to stop, as a launcher's forwarded SIGTERM arrives after the stop file a cancelled driver drops."""
    return SignalInEvaluation(_cnn(image_shape, num_classes))

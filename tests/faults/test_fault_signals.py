"""SIGTERM (what `timeout`, systemd, container stops and Prefect cancellations send) ends `kbit train` as Ctrl-C
does: workers stopped, the MLflow run marked KILLED, temporary directories removed, and a hint how to resume."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import processes_mentioning
from tests.faults.conftest import KBIT

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # exited (or a zombie) meanwhile
        return ""


def _wait_for_ranks(kbit: psutil.Process, deadline_s: float) -> list[psutil.Process]:
    """The command's process tree once torchrun's ranks are running in it."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        tree = kbit.children(recursive=True)
        if any("torch.distributed.run" in _cmdline(p) for p in tree):
            return tree
        assert kbit.is_running(), "kbit train exited before its ranks started"
        time.sleep(0.5)
    raise AssertionError(f"no torchrun ranks within {deadline_s}s")


def test_sigterm_mid_training_cleans_up_and_marks_the_run_killed(broker, tmp_path, topic_name, record_property):
    workdir, tmpdir = tmp_path / "run", tmp_path / "tmpdir"
    tmpdir.mkdir()
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sets = [
        f"workdir={workdir}",
        f"kafka.embedded.port={broker.port}",
        f"produce.topic={topic_name}",
        "dataset.num_records=4000",
        "train.epochs=5",
        "shard.split_rates=[0.8,0.1,0.1]",
        "checkpoint.dir=ckpt",
        f"tracking.tracking_uri={tracking_uri}",
        "tracking.system_metrics=false",
    ]
    log = (tmp_path / "kbit.log").open("w")
    command = subprocess.Popen(
        [str(KBIT), "train", *(a for s in sets for a in ("--set", s))],
        stdout=log,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    tree = _wait_for_ranks(psutil.Process(command.pid), deadline_s=300)
    time.sleep(3)  # into the first epoch
    tree += [p for p in psutil.Process(command.pid).children(recursive=True) if p not in tree]
    sent = time.monotonic()
    command.send_signal(signal.SIGTERM)
    _, stderr = command.communicate(timeout=120)
    record_property("seconds", round(time.monotonic() - sent, 2))

    assert command.returncode == 130, stderr[-3000:]
    assert (
        "interrupted: stopped the workers and cleaned up; with checkpoint.dir set, rerun with --set "
        "checkpoint.resume=latest to continue" in stderr
    )
    assert "Traceback" not in stderr, stderr[-3000:]
    runs = MlflowClient(tracking_uri).search_runs(
        [MlflowClient(tracking_uri).get_experiment_by_name("kbit-default").experiment_id]
    )
    assert [r.info.status for r in runs] == ["KILLED"]
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == [], f"left running: {[(p.pid, _cmdline(p)[:200]) for p in alive]}"
    assert processes_mentioning(str(workdir)) == []
    assert list((workdir / "spark").glob("run-*")) == [], "the run's TMPDIR was not removed"
    assert list(tmpdir.rglob("torchelastic_*")) == []

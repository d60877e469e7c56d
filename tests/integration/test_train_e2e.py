"""Training end to end through TorchDistributor on data streamed from the real broker: DDP, DeepSpeed, failures."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbit_core.config import load_config
from kbit_core.errors import DistributedError
from kbit_core.jobs.train import train
from kbit_core.launch.spark import worker_tmp_dir
from tests.conftest import REPO, SMALL_TRAINING, processes_mentioning

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


@pytest.mark.slow
def test_train_smoke_profile_reaches_90_percent(spark, broker, tmp_path, topic_name, audited_tmpdir, launch_debris):
    cfg = load_config(
        REPO / "deployments" / "train-smoke.yaml",
        {
            "workdir": str(tmp_path / "kbit"),
            "kafka": {"embedded": {"port": broker.port}},
            "produce": {"topic": topic_name},
        },
    )
    result = train(cfg, progress=False)
    assert result["test_accuracy"] >= 0.90, result
    assert result["engine"] == "ddp" and result["backend"] == "gloo" and result["world_size"] == 2
    assert result["samples_per_s"] > 0 and result["restarts"] == 0
    assert "tracking_error" not in result
    assert Path(result["checkpoint"]).is_file()
    assert launch_debris(audited_tmpdir, cfg.run_dir, worker_tmp_dir()) == []
    from mlflow.tracking import MlflowClient

    run = MlflowClient(cfg.tracking_uri()).get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] == pytest.approx(result["test_accuracy"])
    assert run.data.params["train.epochs"] == "3"


def test_deepspeed_zero_trains(spark, make_config, topic_name):
    cfg = make_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        deepspeed__enabled=True,
        deepspeed__zero_stage=2,
        train__model={"name": "mlp"},
        train__optim={"name": "adam", "lr": 0.003},
    )
    result = train(cfg, progress=False)
    assert result["engine"] == "deepspeed-zero2"
    curve = result["loss_curve"]
    assert len(curve) == result["steps"] == 25
    assert sum(curve[-5:]) / 5 < 0.9 * sum(curve[:5]) / 5, curve


def test_worker_failure_restarts_from_the_latest_checkpoint(
    spark, make_config, topic_name, tmp_path, fault_models_importable, caplog
):
    marker = tmp_path / "fault-fired"
    cfg = make_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        train__model={"name": "fault_models:crash_once", "kwargs": {"at_step": 15, "marker": str(marker)}},
        checkpoint={"dir": "checkpoints", "every_steps": 10, "max_restarts": 1},
    )
    with caplog.at_level(logging.WARNING, logger="kbit_core.jobs.restarts"):
        result = train(cfg, progress=False)
    assert marker.exists(), "the fault never fired, so nothing was restarted"
    assert result["restarts"] == 1 and result["steps"] == 25
    restart_logs = [r.getMessage() for r in caplog.records if "restart 1 of 1" in r.getMessage()]
    assert len(restart_logs) == 1 and "RuntimeError" in restart_logs[0] and "step-00000010" in restart_logs[0]


def test_without_restarts_left_the_worker_failure_is_raised(
    spark, make_config, topic_name, tmp_path, fault_models_importable
):
    cfg = make_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        train__model={"name": "fault_models:crash_once", "kwargs": {"at_step": 3, "marker": str(tmp_path / "fired")}},
    )
    with pytest.raises(
        DistributedError, match=r"rank1 on host \S+ raised:(.|\n)*RuntimeError: injected fault at step 3"
    ):
        train(cfg, progress=False)


@pytest.mark.slow
def test_kbit_train_cli_prints_json_and_leaves_nothing_behind(broker, tmp_path, topic_name, launch_debris):
    workdir, tmpdir = tmp_path / "cli-run", tmp_path / "tmpdir"
    tmpdir.mkdir()
    sets = [
        f"workdir={workdir}",
        f"kafka.embedded.port={broker.port}",
        f"produce.topic={topic_name}",
        "dataset.num_records=2000",
        "train.epochs=1",
        "shard.split_rates=[0.8,0.1,0.1]",
        "tracking.enabled=false",
    ]
    cmd = [str(Path(sys.executable).parent / "kbit"), "train", "--json"] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert 0.0 <= result["test_accuracy"] <= 1.0 and result["samples_per_s"] > 0
    assert result["world_size"] == 2 and result["topic"] == topic_name
    assert processes_mentioning(str(workdir)) == [], "a JVM or worker of the finished command is still running"
    assert launch_debris(tmpdir, workdir) == []

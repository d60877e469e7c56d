"""Ray Train as the second engine, on the real broker and a real Ray head: the head stays on loopback, the train-ray
profile learns, both engines read the same samples on each rank, and a killed rank resumes to identical weights."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from kbit_core.config import is_loopback
from kbit_core.jobs.train import train
from kbit_core.launch import launch
from kbit_core.launch.distributor import RankDiedError, WorkerFailedError
from kbit_core.produce import produce_dataset
from kbit_core.ray_env import own_token_file
from kbit_core.train import checkpoint as ckpt
from tests.conftest import REPO, SMALL_TRAINING, TEST_HOME
from tests.ray.engine_entries import rank_sample_indices

pytestmark = [pytest.mark.kafka, pytest.mark.ray]


def listening_sockets(head: psutil.Process) -> list[tuple[str, psutil._common.addr]]:
    return [
        (p.name(), c.laddr)
        for p in [head, *head.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def train_ray_profile(
    sets: dict[str, object], *, timeout_s: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kbit train --config deployments/train-ray.yaml --json`` with ``sets`` as ``--set`` overrides, in a process
    of its own (a process joins one Ray cluster once)."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "kbit"),
            "train",
            "--config",
            str(REPO / "deployments" / "train-ray.yaml"),
            "--json",
            *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")],
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=env,
    )


def test_the_ray_head_listens_on_loopback_only(ray_head_service):
    head = psutil.Process(ray_head_service.pid())
    deadline = time.monotonic() + 60
    while {"gcs_server", "raylet"} - {name for name, _ in listening_sockets(head)} and time.monotonic() < deadline:
        time.sleep(0.5)  # the GCS port answers first; the raylet comes up after it
    listening = listening_sockets(head)
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening}, listening
    exposed = [(name, addr) for name, addr in listening if not is_loopback(addr.ip.removeprefix("::ffff:"))]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"


@pytest.mark.slow
def test_train_ray_profile_reaches_90_percent_through_the_cli(broker, ray_head_service, tmp_path, topic_name):
    sets = {
        "workdir": tmp_path / "kbit",
        "kafka.embedded.port": broker.port,
        "produce.topic": topic_name,
        "launch.ray_address": ray_head_service.url,
        "tracking.enabled": "false",
        "launch.ray_auth_token_file": own_token_file(ray_head_service.run_dir),
    }
    done = train_ray_profile(sets)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["test_accuracy"] >= 0.90, result
    assert result["world_size"] == 2 and result["engine"] == "ddp" and result["restarts"] == 0
    assert {r["address"] for r in result["ranks"]} == {"127.0.0.1"}, result["ranks"]


@pytest.mark.spark
def test_both_engines_read_the_same_samples_on_each_rank(spark, make_ray_config, topic_name, fault_models_importable):
    cfg = make_ray_config(SMALL_TRAINING, produce__topic=topic_name)
    manifest_json = produce_dataset(cfg, progress=False).model_dump_json()
    under_ray = launch(rank_sample_indices, cfg, manifest_json)
    under_spark = launch(rank_sample_indices, cfg.override({"launch.engine": "spark"}), manifest_json)
    assert under_ray == under_spark
    assert [r["rank"] for r in under_ray] == [0, 1]
    train_sets = [set(r["train"]) for r in under_ray]
    assert not train_sets[0] & train_sets[1] and len(train_sets[0]) == len(train_sets[1]) > 0


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_under_ray_resumes_to_the_weights_of_an_uninterrupted_run(
    make_ray_config, topic_name, tmp_path, fault_models_importable, caplog
):
    def run(marker_dir, times, checkpoints):
        marker_dir.mkdir()
        return train(
            make_ray_config(
                SMALL_TRAINING,
                produce__topic=topic_name,
                train__model={
                    "name": "fault_models:kill_each_attempt",
                    "kwargs": {"at_step": 10, "marker_dir": str(marker_dir), "times": times},
                },
                checkpoint={"dir": checkpoints, "every_steps": 4, "max_restarts": 1},
            ),
            progress=False,
        )

    with caplog.at_level(logging.WARNING, logger="kbit_core.jobs.restarts"):
        killed = run(tmp_path / "kills", 1, "checkpoints-killed")
    assert len(list((tmp_path / "kills").glob("kill-*"))) == 1
    restarts = [r.getMessage() for r in caplog.records if "restart 1 of 1" in r.getMessage()]
    assert len(restarts) == 1 and "training failed on rank1 (host 127.0.0.1) with ActorDiedError" in restarts[0]
    assert killed["restarts"] == 1 and killed["steps"] == 25
    clean = run(tmp_path / "clean", 0, "checkpoints-clean")
    assert clean["restarts"] == 0 and clean["loss_curve"] == killed["loss_curve"]
    ours, theirs = (ckpt.read_file(Path(r["checkpoint"]))[ckpt.MODEL] for r in (killed, clean))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_deepspeed_zero_trains_under_ray(make_ray_config, topic_name):
    cfg = make_ray_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        deepspeed__enabled=True,
        deepspeed__zero_stage=2,
        train__model={"name": "mlp"},
        train__optim={"name": "adam", "lr": 0.003},
    )
    result = train(cfg, progress=False)
    assert result["engine"] == "deepspeed-zero2" and result["world_size"] == 2
    curve = result["loss_curve"]
    assert len(curve) == result["steps"] == 25
    assert sum(curve[-5:]) / 5 < 0.9 * sum(curve[:5]) / 5, curve


@pytest.mark.slow
def test_a_rank_that_raises_under_ray_is_named_with_its_exception(
    make_ray_config, topic_name, tmp_path, fault_models_importable
):
    cfg = make_ray_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        train__model={"name": "fault_models:crash_once", "kwargs": {"at_step": 3, "marker": str(tmp_path / "fired")}},
        checkpoint__max_restarts=0,
    )
    with pytest.raises(WorkerFailedError) as info:
        train(cfg, progress=False)
    error = info.value
    assert (error.rank, error.exception_type) == ("rank1", "RuntimeError")
    assert "injected fault at step 3" in str(error) and not isinstance(error, RankDiedError)


def test_ray_state_is_kbits_own_token_not_the_home_directory(make_ray_config, ray_head_service, topic_name):
    from kbit_core.launch.ray_train import ensure_ray

    ensure_ray(make_ray_config(produce__topic=topic_name))  # this process joins the session head (once)

    token = own_token_file(ray_head_service.run_dir)
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token) and os.environ["RAY_AUTH_MODE"] == "token"
    assert Path.home() == TEST_HOME and not (Path.home() / ".ray").exists()


def test_joining_a_head_without_its_token_is_refused_naming_the_setting(broker, ray_head_service, tmp_path):
    sets = {
        "workdir": tmp_path / "kbit",
        "kafka.embedded.port": broker.port,
        "launch.engine": "ray",
        "launch.ray_address": ray_head_service.url,
        "tracking.enabled": "false",
    }
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    done = train_ray_profile(sets, timeout_s=300, env=env)
    assert done.returncode != 0
    assert f"Ray cluster at 127.0.0.1:{ray_head_service.port} asks for its token" in done.stderr, done.stderr[-3000:]
    assert "launch.ray_auth_token_file" in done.stderr
    assert not own_token_file(tmp_path / "kbit").exists(), "joining never creates a token"

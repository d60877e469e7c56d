"""A rank killed without a Python error (kill -9, OOM, segfault) is named from torchrun's records and restarted."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from kbit_core.jobs.train import train
from kbit_core.launch.distributor import RankDiedError
from kbit_core.train import checkpoint as ckpt
from tests.conftest import SMALL_TRAINING, processes_mentioning

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]

KILLS = 5


def _config(make_config, topic_name, marker_dir, times, *, restarts):
    # A checkpoint every 4 steps and a kill 6 steps into each attempt: every attempt makes progress, so 5 kills
    # land at steps 6, 10, 14, 18 and 22 of the 25, and the sixth attempt finishes.
    return make_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        train__model={
            "name": "fault_models:kill_each_attempt",
            "kwargs": {"at_step": 6, "marker_dir": str(marker_dir), "times": times},
        },
        checkpoint={"dir": "checkpoints", "every_steps": 4, "every_epoch": True, "max_restarts": restarts},
    )


def test_a_rank_killed_five_times_restarts_five_times_and_matches_an_uninterrupted_run(
    spark, make_config, topic_name, tmp_path, fault_models_importable, caplog, record_property
):
    killed_dir, clean_dir = tmp_path / "kills", tmp_path / "clean"
    killed_dir.mkdir()
    clean_dir.mkdir()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kbit_core.jobs.restarts"):
        killed = train(
            _config(make_config, topic_name, killed_dir, KILLS, restarts=KILLS).override(
                {"checkpoint.dir": "checkpoints-killed"}
            ),
            progress=False,
        )
    record_property("seconds", round(time.monotonic() - started, 2))
    assert len(list(killed_dir.glob("kill-*"))) == KILLS
    assert killed["restarts"] == KILLS and killed["steps"] == 25
    restarts = [r.getMessage() for r in caplog.records if "restart " in r.getMessage()]
    assert len(restarts) == KILLS
    assert all("training failed on rank1 (host " in m and "with SIGKILL" in m for m in restarts), restarts[0]

    clean = train(
        _config(make_config, topic_name, clean_dir, 0, restarts=0).override({"checkpoint.dir": "checkpoints-clean"}),
        progress=False,
    )
    assert clean["restarts"] == 0 and clean["loss_curve"] == killed["loss_curve"]
    ours, theirs = (ckpt.read_file(Path(r["checkpoint"]))[ckpt.MODEL] for r in (killed, clean))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert processes_mentioning(str(tmp_path)) == [], "a JVM, torchrun agent or rank outlived the runs"


def test_without_restarts_the_killed_rank_is_named_with_its_signal(
    spark, make_config, topic_name, tmp_path, fault_models_importable, record_property
):
    started = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        train(_config(make_config, topic_name, tmp_path, 1, restarts=0), progress=False)
    record_property("seconds", round(time.monotonic() - started, 2))
    error = info.value
    assert (error.rank, error.exception_type, error.exit.exitcode) == ("rank1", "SIGKILL", -9)
    assert f"rank 1 on host {error.host}" in str(error) and "killed by SIGKILL" in str(error)

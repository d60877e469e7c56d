"""launch.engine=torchrun: plain torchrun on this host, the same contract as the TorchDistributor launch."""

from __future__ import annotations

import os
import signal

import pytest

from kbit_core.errors import DistributedError
from kbit_core.jobs.train import train
from kbit_core.launch import launch
from kbit_core.launch.distributor import RankDiedError, WorkerFailedError, errors_dir
from tests.conftest import SMALL_TRAINING
from tests.integration.test_launch import fail_on_rank, rank_report


def kill_rank(cfg, victim: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.fixture
def torchrun_config(make_config):
    return make_config(launch__engine="torchrun")


def test_rank0_result_comes_back_and_nothing_is_left_behind(torchrun_config, audited_tmpdir, launch_debris):
    result = launch(rank_report, torchrun_config, 0.5)
    assert {k: result[k] for k in ("rank", "world_size", "rank_sum", "profile")} == {
        "rank": 0,
        "world_size": 2,
        "rank_sum": 1,
        "profile": torchrun_config.profile,
    }
    assert result["pid"] != os.getpid()
    assert launch_debris(audited_tmpdir, torchrun_config.run_dir) == []
    leftovers = [p.name for p in torchrun_config.run_dir.glob("kbit-torchrun-*")]
    assert leftovers == []  # the scratch directory held the config (secrets included)


def test_a_rank_exception_names_the_rank_and_keeps_its_traceback(torchrun_config):
    with pytest.raises(WorkerFailedError) as info:
        launch(fail_on_rank, torchrun_config, 1)
    assert (info.value.rank, info.value.exception_type) == ("rank1", "ValueError")
    assert "torchrun --standalone nproc_per_node=2" in str(info.value)
    assert "ValueError: batch 7 has 3 labels for 4 images on rank 1" in str(info.value)
    assert "ValueError" in (errors_dir(torchrun_config.run_dir) / "rank1.txt").read_text()


def test_a_killed_rank_is_reported_as_died_with_its_signal(torchrun_config):
    with pytest.raises(RankDiedError) as info:
        launch(kill_rank, torchrun_config, 1)
    assert (info.value.rank, info.value.exception_type) == ("rank1", "SIGKILL")


def test_an_entry_the_ranks_cannot_import_is_refused_before_launch(torchrun_config):
    def local_entry(cfg):
        return 1

    with pytest.raises(DistributedError, match="not a module-level function"):
        launch(local_entry, torchrun_config)


def test_an_entry_that_fails_to_import_in_a_rank_is_that_ranks_error(torchrun_config, tmp_path, monkeypatch):
    (tmp_path / "host_only_entry.py").write_text(
        "import os\n"
        "if 'RANK' in os.environ:\n"
        "    raise ImportError('libfoo is installed on the driver host only')\n"
        "def entry(cfg):\n"
        "    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from host_only_entry import entry

    with pytest.raises(WorkerFailedError) as info:
        launch(entry, torchrun_config)
    assert info.value.exception_type == "ImportError"
    assert "libfoo is installed on the driver host only" in str(info.value)
    assert "ImportError" in (errors_dir(torchrun_config.run_dir) / "rank0.txt").read_text()


def test_training_restarts_from_its_checkpoint_after_a_worker_failure(
    make_config, topic_name, tmp_path, fault_models_importable
):
    marker = tmp_path / "fault-fired"
    cfg = make_config(
        SMALL_TRAINING,
        produce__topic=topic_name,
        launch__engine="torchrun",
        train__model={"name": "fault_models:crash_once", "kwargs": {"at_step": 15, "marker": str(marker)}},
        checkpoint={"dir": "checkpoints", "every_steps": 10, "max_restarts": 1},
    )
    result = train(cfg, progress=False)
    assert marker.exists(), "the fault never fired, so nothing was restarted"
    assert result["restarts"] == 1 and result["steps"] == 25
    assert result["world_size"] == 2 and result["backend"] == "gloo"

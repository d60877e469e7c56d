"""Checkpoint files: atomic writes, keep-last-K, async saves, weights_only loading, RNG round trips, resume lookup."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.elastic import check_elastic

CPU = torch.device("cpu")


def state(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.rand(4, 3)).sum().backward()
    opt.step()
    return {
        ckpt.MODEL: model.state_dict(),
        ckpt.OPTIMIZER: opt.state_dict(),
        ckpt.TRAIN_STATE: {"step": step, "history": [{"loss": 0.5}]},
        ckpt.RANKS: [{"rng": ckpt.rng_state(CPU), "loader": {"epoch": 0, "position": step}}],
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_write_keeps_last_k_and_loads_with_weights_only(tmp_path: Path, async_save: bool) -> None:
    writer = ckpt.Checkpointer(tmp_path, keep_last=2, async_save=async_save)
    saved = {step: state(step) for step in (1, 2, 3)}
    for step, st in saved.items():
        writer.write_file(ckpt.checkpoint_name(step), st)
    writer.wait()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000002.pt", "step-00000003.pt"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000002.pt", "step-00000003.pt"]  # no temp debris
    loaded = ckpt.read_file(ckpt.latest_checkpoint(tmp_path))
    for name, tensor in saved[3][ckpt.MODEL].items():
        assert torch.equal(loaded[ckpt.MODEL][name], tensor)
    assert loaded[ckpt.TRAIN_STATE] == {"step": 3, "history": [{"loss": 0.5}]}
    assert loaded[ckpt.RANKS][0]["loader"] == {"epoch": 0, "position": 3}


def test_async_save_snapshots_state_before_training_continues(tmp_path: Path) -> None:
    writer = ckpt.Checkpointer(tmp_path, keep_last=3, async_save=True)
    weights = torch.zeros(1000)
    writer.write_file("step-00000001", {ckpt.MODEL: {"w": weights}})
    weights += 1  # the optimizer keeps updating in place while the background write runs
    writer.wait()
    assert torch.equal(ckpt.read_file(tmp_path / "step-00000001.pt")[ckpt.MODEL]["w"], torch.zeros(1000))


def test_failed_background_save_is_raised_not_lost(tmp_path: Path) -> None:
    writer = ckpt.Checkpointer(tmp_path / "ckpt", keep_last=3, async_save=True)
    (tmp_path / "ckpt").rmdir()  # the directory vanishes under the writer
    writer.write_file("step-00000001", {ckpt.MODEL: {"w": torch.ones(2)}})
    with pytest.raises(FileNotFoundError):
        writer.wait()


def test_interrupted_write_leaves_previous_checkpoint_as_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ckpt.Checkpointer(tmp_path, keep_last=3)
    writer.write_file("step-00000001", state(1))

    def crash(obj: object, path: str) -> None:
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        writer.write_file("step-00000002", state(2))
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-00000001.pt"
    assert os.listdir(tmp_path) == ["step-00000001.pt"]


def test_weights_only_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "step-00000001.pt"
    torch.save({ckpt.MODEL: {}, "payload": pickle.dumps}, path)  # an arbitrary callable, as an attacker would
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckpt.read_file(path)


def test_rng_state_round_trips_python_numpy_torch(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    saved = ckpt.rng_state(CPU)
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    # Through both storage forms: a weights_only torch file and the JSON side file of DeepSpeed checkpoints.
    torch.save({"rng": saved}, tmp_path / "rng.pt")
    for restored in (ckpt.read_file(tmp_path / "rng.pt")["rng"], json.loads(json.dumps(saved))):
        ckpt.set_rng_state(restored, CPU)
        again = (random.random(), np.random.normal(), torch.rand(3))
        assert again[0] == expected[0] and again[1] == expected[1] and torch.equal(again[2], expected[2])


def test_sharded_checkpoint_counts_only_once_its_side_file_exists(tmp_path: Path) -> None:
    writer = ckpt.Checkpointer(tmp_path, keep_last=1)
    (tmp_path / "step-00000005").mkdir()  # DeepSpeed shards written, side file not yet
    writer.write_file("step-00000004", state(4))
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-00000004.pt"
    writer.write_side_file("step-00000005", {ckpt.TRAIN_STATE: {"step": 5}, ckpt.RANKS: [None]})
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-00000005"
    assert ckpt.read_side_file(tmp_path / "step-00000005")[ckpt.TRAIN_STATE] == {"step": 5}
    assert not (tmp_path / "step-00000004.pt").exists()  # keep_last=1 pruned the older one


def config(**checkpoint) -> KbitConfig:
    return KbitConfig.from_dict({"checkpoint": {"dir": "ckpt", **checkpoint}})


def test_resolve_resume(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert ckpt.resolve_resume(config(resume="none"), root, tmp_path) is None
    assert ckpt.resolve_resume(config(resume="latest"), root, tmp_path) is None  # nothing saved yet
    writer, _ = ckpt.open_lineage(config(), tmp_path, is_main=True, sharded=False)
    saved = writer.write_file("step-00000007", state(7))
    assert ckpt.resolve_resume(config(resume="latest"), root, tmp_path) == saved
    relative = str(saved.relative_to(tmp_path))
    assert ckpt.resolve_resume(config(resume=relative), None, tmp_path) == saved
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        ckpt.resolve_resume(config(resume="step-00000008.pt"), None, tmp_path)
    lineage = str(writer.directory.relative_to(tmp_path))
    assert ckpt.resolve_resume(config(resume=lineage), None, tmp_path) == saved  # a pinned lineage: its newest
    with pytest.raises(ConfigError, match="resume=latest needs checkpoint.dir"):
        ckpt.resolve_resume(KbitConfig.from_dict({"checkpoint": {"resume": "latest"}}), None, tmp_path)


def test_a_second_run_in_the_same_directory_keeps_its_own_lineage(tmp_path: Path) -> None:
    """The reused-directory defect: run 2's early checkpoints were pruned in favour of run 1's later ones."""
    first, _ = ckpt.open_lineage(config(keep_last=1), tmp_path, is_main=True, sharded=False)
    first.write_file("step-00000050", state(50))
    first.finish()
    second, resume_from = ckpt.open_lineage(config(keep_last=1), tmp_path, is_main=True, sharded=False)
    assert resume_from is None and second.directory != first.directory
    kept = second.write_file("step-00000003", state(3))
    assert kept.is_file(), "run 2's newest checkpoint survives its own keep_last"
    assert ckpt.list_checkpoints(first.directory) == [first.directory / "step-00000050.pt"], "run 1's file untouched"


def test_resume_latest_continues_only_a_compatible_unfinished_lineage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crashed, _ = ckpt.open_lineage(config(), tmp_path, is_main=True, sharded=False)
    crashed_file = crashed.write_file("step-00000004", state(4))
    finished, _ = ckpt.open_lineage(config(), tmp_path, is_main=True, sharded=False)
    finished.write_file("step-00000009", state(9))
    finished.finish()
    other = KbitConfig.from_dict(
        {"checkpoint": {"dir": "ckpt"}, "launch": {"num_processes": 4}, "train": {"global_batch_size": 32}}
    )
    foreign, _ = ckpt.open_lineage(other, tmp_path, is_main=True, sharded=False)
    foreign.write_file("step-00000020", state(20))

    with caplog.at_level("INFO", logger="kbit_core.train.checkpoint"):
        writer, resume_from = ckpt.open_lineage(config(resume="latest"), tmp_path, is_main=True, sharded=False)
    assert resume_from == crashed_file
    assert writer.directory == crashed.directory, "the resumed run keeps writing its own lineage"
    log = caplog.text
    assert f"{foreign.directory}: it was written with other settings (train.global_batch_size: 32 != 64" in log
    assert f"not resuming lineage {finished.directory}: it finished training" in log
    assert f"resuming lineage {crashed.directory.name} from {crashed_file}" in log
    # A rank other than 0 resolves the same checkpoint and gets no writer.
    assert ckpt.open_lineage(config(resume="latest"), tmp_path, is_main=False, sharded=False) == (None, crashed_file)


def test_ddp_and_zero_lineages_continue_at_another_world_size_and_model_parallel_ones_do_not(tmp_path: Path) -> None:
    """Batch-mode DDP checkpoints are re-planned on resume, and ZeRO ones too (through a universal checkpoint), so
    the world size is no lineage setting of theirs; a tensor-parallel or pipeline layout keeps it one, and resuming
    such a checkpoint at another world size is refused in one line naming why."""
    crashed, _ = ckpt.open_lineage(config(), tmp_path, is_main=True, sharded=False)
    crashed_file = crashed.write_file("step-00000004", state(4))
    three = KbitConfig.from_dict({"checkpoint": {"dir": "ckpt", "resume": "latest"}, "launch": {"num_processes": 3}})
    assert ckpt.open_lineage(three, tmp_path, is_main=False, sharded=False) == (None, crashed_file)
    for stage in (1, 2, 3):
        zero = KbitConfig.from_dict(
            {"launch": {"num_processes": 2}, "deepspeed": {"enabled": True, "zero_stage": stage}}
        )
        assert ckpt.lineage_settings(zero)["launch.num_processes"] is None
        check_elastic(zero, tmp_path / "step-00000004", 2, 3)
    pinned = {
        "tensor parallelism": {"train": {"tensor_parallel": {"size": 2}}},
        "pipeline engine": {"train": {"pipeline": {"stages": 2}}, "deepspeed": {"enabled": True}},
    }
    for why, fixed in pinned.items():
        two, four = (KbitConfig.from_dict({"launch": {"num_processes": n}, **fixed}) for n in (2, 4))
        assert ckpt.lineage_settings(two)["launch.num_processes"] == 2
        assert ckpt.lineage_settings(two) != ckpt.lineage_settings(four)
        with pytest.raises(ConfigError, match=rf"written by 2 ranks and this run has 4: .*{why}.*num_processes=2$"):
            check_elastic(four, tmp_path / "step-00000004", 2, 4)


def test_unwritable_checkpoint_dir_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file where the directory should be")
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*ckpt is not writable"):
        ckpt.open_lineage(config(), tmp_path, is_main=True, sharded=False)


def test_the_kept_best_checkpoint_survives_pruning(tmp_path: Path) -> None:
    writer = ckpt.Checkpointer(tmp_path, keep_last=1)
    writer.write_file(ckpt.checkpoint_name(1), state(1))
    writer.keep(ckpt.checkpoint_name(1))
    for step in (2, 3):
        writer.write_file(ckpt.checkpoint_name(step), state(step))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001.pt", "step-00000003.pt"]
    assert writer.find(ckpt.checkpoint_name(1)) == tmp_path / "step-00000001.pt"
    writer.keep(ckpt.checkpoint_name(3))  # a better one: the old best is pruned like any other
    writer.write_file(ckpt.checkpoint_name(4), state(4))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    assert writer.find(ckpt.checkpoint_name(1)) is None


def test_loadable_weights_of_a_deepspeed_checkpoint_are_its_consolidated_file(tmp_path: Path) -> None:
    single = tmp_path / "step-00000001.pt"
    single.write_bytes(b"")
    shards = tmp_path / "step-00000002"
    shards.mkdir()
    assert ckpt.loadable_weights(single) == single and ckpt.loadable_weights(shards) is None
    written = ckpt.write_consolidated(shards, {"w": torch.ones(2)})
    assert ckpt.loadable_weights(shards) == written == shards / ckpt.CONSOLIDATED_FILE
    assert torch.equal(ckpt.read_file(written)["w"], torch.ones(2))

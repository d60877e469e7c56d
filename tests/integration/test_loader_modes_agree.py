"""Every loader mode (reader.workers thread / process / partitions, reader.mode eager, reader.fetch batches) gives the same batches in the same
order, and a rank trained on each, with the same seed, follows the same loss curve: through the real broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kbit_core.config import KbitConfig
from kbit_core.data.split_loaders import make_split_loaders
from kbit_core.kafka.manifest import Manifest
from kbit_core.train.worker import train_main
from tests.conftest import free_port, loader_workers
from tests.integration.dataplane_fixtures import Produce

pytestmark = pytest.mark.kafka

MODES = {
    "thread": {"reader.workers": "thread"},
    "process": {"reader.workers": "process"},
    "partitions": {"reader.workers": "partitions"},
    "eager": {"reader.mode": "eager"},
    "fetched batches": {"reader.fetch": "batches"},
}
GROUPED_LZ4 = {"format": "raw", "layout": "bytes", "compression": "lz4", "records_per_message": 4}
RAW_LZ4 = {"format": "raw", "layout": "bytes", "compression": "lz4"}


def every_batch(cfg: KbitConfig, manifest: Manifest, epochs: list[int]) -> list[tuple[str, int, list[int], Any]]:
    """(split, epoch, indices, (x, y)) of each batch of every split in ``epochs``, from one rank's loaders."""
    seen = []
    with make_split_loaders(cfg, manifest, 0, 1) as loaders:
        loaders.connect()
        for epoch in epochs:
            for split, loader in loaders.items():
                loader.set_epoch(epoch)
                for batch in loader.iter_indexed():
                    seen.append((split, epoch, batch.indices.tolist(), (batch.x, batch.y)))
    return seen


@pytest.mark.parametrize("variant", [RAW_LZ4, GROUPED_LZ4], ids=["one_record", "four_records_per_message"])
def test_every_mode_yields_the_same_batches_in_the_same_order(produce_topic: Produce, variant):
    cfg, manifest = produce_topic(
        variant, 300, partitions=3, shard__block_records=16, train__global_batch_size=10, reader__prefetch_batches=2
    )
    runs = {name: every_batch(cfg.override(mode), manifest, [0, 1]) for name, mode in MODES.items()}
    expected = runs.pop("thread")
    assert {split for split, *_ in expected} == {"train", "val", "test"}
    assert len({tuple(i) for s, e, i, _ in expected if s == "train" and e == 0}) > 1
    for name, got in runs.items():
        assert [(s, e, i) for s, e, i, _ in got] == [(s, e, i) for s, e, i, _ in expected], name
        for (*_, (x, y)), (*_, (ex, ey)) in zip(got, expected):
            assert x.dtype == ex.dtype and torch.equal(x, ex) and torch.equal(y, ey), name
    assert not loader_workers()


def train_one_rank(cfg: KbitConfig, manifest: Manifest, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """``train_main`` as one rank of one, in this process (its loaders' worker processes its children)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    return train_main(cfg, manifest.model_dump_json(), str(run_dir))


def test_a_rank_trained_in_every_mode_follows_the_same_loss_curve(
    produce_topic: Produce, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The model has dropout: a mode that drew from the rank's torch generator (a worker's seed) would change it."""
    cfg, manifest = produce_topic(
        RAW_LZ4,
        400,
        partitions=2,
        shard__block_records=32,
        train__epochs=2,
        train__global_batch_size=16,
        shard__split_rates=[0.8, 0.1, 0.1],
        train__model__name="cnn",
        tracking__enabled=False,
    )
    torch.set_num_threads(1)
    # reader.fetch: batches changes only how the same records are fetched: its batches are compared above
    trained = {name: mode for name, mode in MODES.items() if "reader.fetch" not in mode}
    results = {
        name: train_one_rank(cfg.override(mode), manifest, tmp_path / name, monkeypatch)
        for name, mode in trained.items()
    }
    expected = results.pop("thread")
    assert len(expected["loss_curve"]) == 2 * (320 // 16)  # two epochs of the 320 train records
    for name, result in results.items():
        assert result["loss_curve"] == expected["loss_curve"], name
        assert result["test_accuracy"] == expected["test_accuracy"], name
    assert not loader_workers()

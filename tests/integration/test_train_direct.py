"""``train.data: direct`` through the real launcher (torchrun, gloo CPU ranks): a map-style Dataset from a factory
trains without any broker, resumes mid-epoch exactly, and, produced into Kafka, trains there the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.jobs.train import train
from kbit_core.kafka import admin

FACTORY = "tests.integration.user_datasets:digits"
# 2001 records: 1601 to train, padded to 801 on each of 2 ranks (shard.remainder: pad), 50 steps of 16 per epoch.
DATASET = {"name": "torch", "factory": FACTORY, "kwargs": {"num_records": 2001}}
TRAINING: dict[str, Any] = {
    "dataset": DATASET,
    "shard": {"split_rates": [0.8, 0.1, 0.1], "remainder": "pad"},
    "train": {
        "data": "direct",
        "epochs": 2,
        "global_batch_size": 32,
        "model": {"name": "mlp", "kwargs": {"hidden": 32}},
        "optim": {"lr": 0.003},
    },
    "launch": {"engine": "torchrun", "num_processes": 2},
    "tracking": {"enabled": False},
}


def direct_config(tmp_path: Path, **sections: Any) -> KbitConfig:
    # Nothing listens on port 9: a run that touched Kafka would fail.
    base = {"workdir": str(tmp_path / "kbit"), "kafka": {"bootstrap_servers": "127.0.0.1:9"}}
    return KbitConfig.from_dict(deep_merge(deep_merge(base, TRAINING), sections))


@pytest.mark.slow
@pytest.mark.usefixtures("fault_models_importable")  # the ranks import the factory as a user's package
def test_a_factory_dataset_trains_on_two_ranks_without_kafka_and_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    checkpoints = {"dir": "ckpt", "every_steps": 20, "every_epoch": False, "keep_last": 10}
    result = train(direct_config(tmp_path, checkpoint=checkpoints), progress=False)
    assert result["dataset"].startswith("direct.torch-") and result["world_size"] == 2
    assert result["steps"] == 100 and result["data"]["train"]["padded_messages_per_epoch"] == 1
    assert result["test_accuracy"] > 0.4  # 4x chance after 100 small steps (0.55 measured): labels fit the images
    # Resumed 60 steps in (10 batches into the second epoch), the run continues with exactly the batches it had not
    # trained: the same loss at every step after the checkpoint as the uninterrupted run.
    mid = next(Path(result["checkpoint"]).parent.glob("step-00000060*"))
    resumed = train(direct_config(tmp_path / "resumed", checkpoint={"resume": str(mid)}), progress=False)
    assert resumed["loss_curve"] == result["loss_curve"] and resumed["test_loss"] == result["test_loss"]


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.usefixtures("fault_models_importable")
def test_the_dataset_produced_into_kafka_trains_as_it_does_read_directly(
    make_config: Callable[..., KbitConfig],
) -> None:
    """One partition holds the records in index order, as the direct plan reads them, and raw bytes carry the
    factory's floats k/255 exactly: the streamed run is the direct run, step for step."""
    cfg = make_config(
        TRAINING,
        train__data="kafka",
        train__epochs=1,
        produce__partitions=1,
        produce__variant={"format": "raw", "layout": "bytes", "compression": "lz4"},
    )
    try:
        streamed = train(cfg, progress=False)
    finally:
        admin.delete_topic(cfg.kafka, cfg.produce.topic_for(cfg.dataset))
    assert streamed["topic"] == cfg.produce.topic_for(cfg.dataset) and ".torch-" in streamed["topic"]
    direct = train(cfg.override({"train.data": "direct"}), progress=False)
    assert direct["loss_curve"] == streamed["loss_curve"] and direct["test_loss"] == streamed["test_loss"]

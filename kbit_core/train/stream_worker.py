"""The per-rank entry of continuous training: a StreamSource for this rank's partitions plus the held-out halves."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.kafka.manifest import Manifest
from kbit_core.stream.ledger import assign_partitions
from kbit_core.stream.live_producer import stream_codec
from kbit_core.stream.source import StreamSource
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.rank_data import rank_loaders
from kbit_core.train.stream_trainer import StreamTrainer
from kbit_core.train.worker import run_worker


def heldout_config(cfg: KbitConfig) -> KbitConfig:
    """The held-out topic's config: ``stream.eval_records`` records the stream never carries (another seed of a
    synthetic dataset, the test files of an IDX one), split in halves: validation during training, final test.
    Each rank reads its halves into memory once, so an evaluation never depends on the broker still holding them."""
    topic = f"{cfg.stream.topic_for(cfg.dataset, cfg.produce)}.heldout"
    dataset = (
        {"dataset.seed": cfg.dataset.seed + 1}
        if cfg.dataset.name.startswith("synthetic")
        else {"dataset.split": "test"}
    )
    return cfg.override(
        {
            **dataset,
            "dataset.num_records": cfg.stream.eval_records,
            "produce.topic": topic,
            "shard.split_rates": [0.5, 0.5],
            "train.mode": "batch",
            "train.data": "memory",
            "reader.mode": "eager",
        }
    )


def stream_main(cfg: KbitConfig, heldout_json: str, run_dir: str) -> dict[str, Any]:
    """Train continuously on ``cfg``'s stream topic; the same dict returns on every rank.

    Args:
        cfg: The run's config (``train.mode=continuous``).
        heldout_json: The held-out topic's manifest, inline as the batch entry's manifest is.
        run_dir: Where checkpoints and the result go (shared by every host).
    """
    heldout = Manifest.model_validate_json(heldout_json)
    source = open_source(cfg.dataset)
    codec = stream_codec(cfg, source)
    topic = cfg.stream.topic_for(cfg.dataset, cfg.produce)

    def stream_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
        partitions = assign_partitions(cfg.produce.partitions, env.world_size)[env.rank]
        held = rank_loaders(heldout_config(cfg), heldout, env.rank, env.world_size, share_reader=True)
        return SplitLoaders(
            train=StreamSource(cfg, codec, topic, partitions, cfg.produce.partitions),
            val=held.train,
            test=held.val,
            shared=held.shared,
        )

    return run_worker(cfg, run_dir, stream_loaders, source.image_shape, source.num_classes, trainer_type=StreamTrainer)

"""The per-rank entry of continuous training: a StreamSource for this rank's partitions plus the held-out halves."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.formats import RecordShape
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.stream.ledger import assign_partitions
from kbit_core.stream.live_producer import stream_codec
from kbit_core.stream.source import StreamSource
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.rank_data import rank_loaders
from kbit_core.train.stream_trainer import StreamTrainer
from kbit_core.train.worker import run_worker


def heldout_config(cfg: KbitConfig) -> KbitConfig:
    """The held-out records' config: ``stream.eval_records`` records the stream never trains on, split in halves:
    validation during training, final test. On kbit's live stream they are a topic of their own (another seed of a
    synthetic dataset, the test files of an IDX one); on a user's topic (``source.topic``) its first records, read
    as a snapshot (:func:`kbit_core.jobs.user_stream.heldout_snapshot`). Each rank reads its halves into memory
    once, so an evaluation never depends on the broker still holding them."""
    halves = {
        "shard.split_rates": [0.5, 0.5],
        "shard.split_by": "ratio",
        "shard.split_times": [],
        "train.mode": "batch",
        "train.data": "memory",
        "reader.mode": "eager",
    }
    if cfg.source.topic is not None:
        return cfg.override(halves)
    topic = f"{cfg.stream.topic_for(cfg.dataset, cfg.produce)}.heldout"
    dataset = (
        {"dataset.seed": cfg.dataset.seed + 1}
        if cfg.dataset.name.startswith("synthetic")
        else {"dataset.split": "test"}
    )
    return cfg.override({**dataset, "dataset.num_records": cfg.stream.eval_records, "produce.topic": topic, **halves})


def stream_main(cfg: KbitConfig, heldout_json: str, run_dir: str) -> dict[str, Any]:
    """Train continuously on ``cfg``'s stream topic; the same dict returns on every rank.

    Args:
        cfg: The run's config (``train.mode=continuous``).
        heldout_json: The held-out topic's manifest, inline as the batch entry's manifest is.
        run_dir: Where checkpoints and the result go (shared by every host).
    """
    heldout = Manifest.model_validate_json(heldout_json)
    if cfg.source.topic is not None:  # a user's topic: decoded by the held-out snapshot's mapping, vocabulary included
        records: RecordShape = heldout.dataset
        codec = manifest_codec(heldout, cfg.reader.decoder, cfg.registry)
        # the stream starts past the held-out records, which come first in every partition
        first_offsets = {p.partition: p.first_offset + p.num_messages for p in heldout.partitions}
    else:
        records = open_source(cfg.dataset)
        codec, first_offsets = stream_codec(cfg, records), {}
    topic = cfg.stream.topic_for(cfg.dataset, cfg.produce)

    def stream_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
        partitions = assign_partitions(cfg.produce.partitions, env.world_size)[env.rank]
        held = rank_loaders(heldout_config(cfg), heldout, env.rank, env.world_size, share_reader=True)
        return SplitLoaders(
            train=StreamSource(cfg, codec, topic, partitions, cfg.produce.partitions, first_offsets=first_offsets),
            val=held.train,
            test=held.val,
            shared=held.shared,
        )

    return run_worker(
        cfg, run_dir, stream_loaders, records.image_shape, records.num_classes, trainer_type=StreamTrainer
    )

"""Rank entries the Ray tests launch through both engines (importable by Spark's and Ray's workers alike)."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.kafka.manifest import Manifest
from kbit_core.train.distributed import all_gather, init_process_group, read_env, teardown
from kbit_core.train.rank_data import rank_loaders


def rank_sample_indices(cfg: KbitConfig, manifest_json: str) -> list[dict[str, Any]]:
    """Every rank's epoch-0 sample indices per split, as each rank read them from Kafka, in rank order."""
    env = read_env(cfg.launch.use_gpu)
    init_process_group(env, cfg.launch.timeout_s)
    loaders = rank_loaders(
        cfg, Manifest.model_validate_json(manifest_json), env.rank, env.world_size, share_reader=False
    )
    try:
        read = {
            split: sorted(int(i) for batch in loader.iter_indexed() for i in batch.indices)
            for split, loader in loaders.splits().items()
        }
    finally:
        loaders.close()
    gathered = all_gather({"rank": env.rank, **read}, env)
    teardown()
    return gathered

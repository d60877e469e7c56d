"""The per-rank entry point of ``train.data: direct``: train straight from the dataset source, without Kafka."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.data.dataset_reader import dataset_manifest
from kbit_core.datasets import open_source
from kbit_core.errors import ConfigError
from kbit_core.kafka.manifest import Manifest
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.rank_data import dataset_loaders
from kbit_core.train.worker import run_worker


def train_direct_main(cfg: KbitConfig, manifest_json: str, run_dir: str | Path) -> dict[str, Any]:
    """Train on the dataset ``cfg.dataset`` names, read in this rank; the same dict returns on every rank.

    Every rank opens the dataset itself (a factory's package and a path's files must be there on every host) and
    checks that it is the one the driver planned: ``manifest_json`` is the driver's
    :func:`~kbit_core.data.dataset_reader.dataset_manifest` of it.
    """
    source = open_source(cfg.dataset, exact=True)
    manifest = dataset_manifest(cfg, source)
    differences = manifest.matches(Manifest.model_validate_json(manifest_json))
    if differences:
        raise ConfigError(f"this rank opened another dataset than the driver planned: {'; '.join(differences)}")

    def direct_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
        return dataset_loaders(cfg, source, manifest, env.rank, env.world_size)

    return run_worker(cfg, run_dir, direct_loaders, source.image_shape, source.num_classes)

"""Fixtures shared by the data-plane read tests: produce a variant into the session broker, and the source truth."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kbit_core.config import DatasetConfig, DataVariant, KbitConfig
from kbit_core.datasets import open_source
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest
from kbit_core.kafka.producer import produce_dataset

Produce = Callable[..., tuple[KbitConfig, Manifest]]


@pytest.fixture
def produce_topic(make_config: Callable[..., KbitConfig]) -> Iterator[Produce]:
    """``produce_topic(variant, num_records=40, partitions=2, **dotted) -> (cfg, manifest)``; topics deleted after."""
    made: list[tuple[KbitConfig, str]] = []

    def _produce(variant: DataVariant | dict[str, Any], num_records: int = 40, partitions: int = 2,
                 **dotted: Any) -> tuple[KbitConfig, Manifest]:
        variant = variant if isinstance(variant, DataVariant) else DataVariant(**variant)
        cfg = make_config(dataset__num_records=num_records, produce__partitions=partitions, **dotted)
        manifest = produce_dataset(cfg, variant, progress=False)
        made.append((cfg, manifest.topic))
        return cfg, manifest

    yield _produce
    for cfg, topic in made:
        admin.delete_topic(cfg.kafka, topic)


def source_truth(cfg: KbitConfig) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8[n, C, H, W], labels int64[n]) of the configured dataset, indexed by sample index."""
    return _generated(cfg.dataset.name, cfg.dataset.num_records, cfg.dataset.seed)


@functools.lru_cache(maxsize=4)
def _generated(name: str, num_records: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    source = open_source(DatasetConfig(name=name, num_records=num_records, seed=seed))
    images, labels = [], []
    for _, imgs, labs in source.batches(0, source.num_records):
        images.append(imgs)
        labels.append(labs)
    return np.concatenate(images), np.concatenate(labels)

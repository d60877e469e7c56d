"""Fixtures shared by the data-plane read tests: produce a variant into the session broker, and the source truth."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer

from kbit_core.config import DatasetConfig, DataVariant, KbitConfig
from kbit_core.datasets import open_source
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest
from kbit_core.produce import produce_dataset

Produce = Callable[..., tuple[KbitConfig, Manifest]]


@pytest.fixture
def produce_topic(make_config: Callable[..., KbitConfig]) -> Iterator[Produce]:
    """``produce_topic(variant, num_records=40, partitions=2, **dotted) -> (cfg, manifest)``; topics deleted after."""
    made: list[tuple[KbitConfig, str]] = []

    def _produce(
        variant: DataVariant | dict[str, Any], num_records: int = 40, partitions: int = 2, **dotted: Any
    ) -> tuple[KbitConfig, Manifest]:
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


RAW = {"format": "raw", "layout": "bytes", "compression": "none"}


def inject(cfg: KbitConfig, topic: str, partition: int, value: bytes) -> int:
    """Append ``value`` to ``partition`` with a plain producer; its offset."""
    producer = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    offsets: list[int] = []
    producer.produce(topic, value=value, partition=partition, on_delivery=lambda err, msg: offsets.append(msg.offset()))
    assert producer.flush(10) == 0 and offsets
    return offsets[0]


def extended(manifest: Manifest, partition: int, extra: int) -> Manifest:
    """The manifest claiming ``extra`` more single-record messages at the end of ``partition``."""
    parts = [
        p.model_copy(
            update={
                "last_offset": p.last_offset + extra,
                "num_messages": p.num_messages + extra,
                "num_records": p.num_records + extra,
            }
        )
        if p.partition == partition
        else p
        for p in manifest.partitions
    ]
    return manifest.model_copy(
        update={
            "partitions": parts,
            "num_messages": manifest.num_messages + extra,
            "num_records": manifest.num_records + extra,
        }
    )


# How a RangeReader fetches: through each client's consumer, and by kbit's own Fetch requests (reader.fetch: batches)
READERS = ["confluent", "kafka-python", "batches"]


def reader_settings(reader: str) -> tuple[str, dict[str, Any]]:
    """A :data:`READERS` entry as (the client RangeReader is given, config overrides in ``__`` form)."""
    return ("confluent", {"reader__fetch": "batches"}) if reader == "batches" else (reader, {})

"""Training straight from a dataset source (``train.data: direct``): no broker, no produce step.

The dataset is described as if produced in index order into one partition (:func:`dataset_manifest`): offset i is
record i. So the shard planner, the block shuffle, the batch assembly, the loader's counts and its resume state are
those of a Kafka topic: every rank takes the same number of steps (``shard.remainder``), each epoch is shuffled from
``shard.seed``, and a mid-epoch checkpoint resumes with exactly the records not yet trained, at the same or (elastic)
another world size. :class:`DatasetReader` stands where the loader's Kafka reader stands, reading index ranges from
the source instead of offset ranges from a topic.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.data.reader import ReaderStats
from kbit_core.datasets import DatasetSource
from kbit_core.errors import ConfigError
from kbit_core.formats.base import DecodedBatch
from kbit_core.kafka.manifest import DatasetInfo, Manifest, PartitionManifest
from kbit_core.sharding import OffsetRange

DIRECT = "direct"


def dataset_manifest(cfg: KbitConfig, source: DatasetSource) -> Manifest:
    """The manifest of ``source`` as one partition whose offsets are its record indices (see the module docstring);
    its topic name, which the loader states' plan hash includes, names the dataset."""
    count = source.num_records
    info = DatasetInfo(
        name=source.name,
        seed=cfg.dataset.seed,
        num_records=count,
        image_shape=source.image_shape,
        num_classes=source.num_classes,
    )
    partition = PartitionManifest(
        partition=0, first_offset=0, last_offset=count - 1, num_messages=count, num_records=count, value_bytes=0
    )
    return Manifest(
        topic=f"{DIRECT}.{source.name}.s{cfg.dataset.seed}.n{count}",
        dataset=info,
        variant=DataVariant(records_per_message=1),
        schema_fingerprint=DIRECT,
        partitions=[partition],
        num_messages=count,
        num_records=count,
        value_bytes=0,
        produce_seconds=0.0,
        client=DIRECT,
        kbit_version=DIRECT,
    )


def check_direct(cfg: KbitConfig) -> None:
    """ConfigError for the settings that need a topic: a loader's worker process reads with a consumer of its own."""
    if cfg.train.data == DIRECT and cfg.reader.workers == "process":
        raise ConfigError(
            "train.data=direct reads the dataset in the rank; reader.workers=process reads Kafka in a child process: "
            "use reader.workers=thread"
        )


class DatasetReader:
    """Reads a source's index ranges for a :class:`~kbit_core.data.loader.ShardLoader` in place of its
    :class:`~kbit_core.data.reader.RangeReader` (the methods the stream and eager modes call). Reading and decoding
    are one step here (the fetch thread does both); ``stats`` counts records and their read time."""

    def __init__(self, source: DatasetSource, manifest: Manifest) -> None:
        self.source, self.topic = source, manifest.topic
        self.client = None
        self.codec = None
        self.stats = ReaderStats()

    def read_raw(self, ranges: Sequence[OffsetRange]) -> Iterator[tuple[OffsetRange, DecodedBatch]]:
        for rng in ranges:
            t0 = time.perf_counter()
            parts = list(self.source.batches(rng.start, rng.stop, max(1, len(rng))))
            indices, images, labels = (np.concatenate(col) for col in zip(*parts, strict=True))
            self.stats.fetch_seconds += time.perf_counter() - t0
            self.stats.messages += len(labels)
            self.stats.records += len(labels)
            yield rng, DecodedBatch(indices=indices, labels=labels, pixels=images)

    def decode_ranges(self, fetched: Iterable[tuple[OffsetRange, Any]]) -> Iterator[tuple[OffsetRange, Any]]:
        """What :meth:`read_raw` yielded: it decoded already."""
        return iter(fetched)

    def read(self, ranges: Sequence[OffsetRange]) -> Iterator[tuple[OffsetRange, DecodedBatch]]:
        return self.read_raw(ranges)

    def close(self) -> None:
        """Nothing to release: the source is read in the rank."""

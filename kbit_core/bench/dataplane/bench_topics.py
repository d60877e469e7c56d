"""A benchmark's topics: the run's config at a given size, its topic produced or reused, and dropped afterwards when
the run made it."""

from __future__ import annotations

from datetime import UTC, datetime

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.produce import produce_dataset


def bench_config(cfg: KbitConfig, num_records: int | None, mode: str | None = None) -> KbitConfig:
    """The run's config with the requested size and reader mode, and one split holding every record."""
    changes: dict[str, object] = {"shard.split_rates": [1.0]}
    if num_records is not None:
        changes["dataset.num_records"] = num_records
    if mode is not None:
        changes["reader.mode"] = mode
    return cfg.override(changes)


def produce_or_reuse(cfg: KbitConfig, variant: DataVariant, progress: bool) -> tuple[Manifest, bool]:
    """(manifest, created by this call): an existing matching topic is reused and left in place."""
    started = datetime.now(UTC)
    manifest = produce_dataset(cfg, variant, progress=progress)
    return manifest, manifest.created_at >= started


def drop_topic(cfg: KbitConfig, manifest: Manifest) -> None:
    admin.delete_topic(cfg.kafka, manifest.topic)
    manifest_path(cfg.workdir, manifest.topic).unlink(missing_ok=True)

"""One rank's split loaders over a produced topic: the single factory training and the benchmark both use."""

from __future__ import annotations

from kbit_core.config import KbitConfig
from kbit_core.data.dataset_reader import DatasetReader, check_direct
from kbit_core.data.loader import ShardLoader
from kbit_core.data.split_loaders import make_split_loader, make_split_loaders
from kbit_core.datasets import DatasetSource
from kbit_core.kafka.manifest import Manifest
from kbit_core.sharding import split_names
from kbit_core.train.loop import SplitLoaders


def rank_loaders(
    cfg: KbitConfig, manifest: Manifest, rank: int, world_size: int, *, share_reader: bool
) -> SplitLoaders:
    """The loaders of every split ``shard.split_rates`` defines for ``rank`` of ``world_size``.

    ``share_reader=True`` reads every split through one consumer with one bounds check (the benchmark's
    one-client-per-rank measurement; ``SplitLoaders.shared`` then holds that reader set). Otherwise each
    split gets its own reader, so its counts (skipped, gaps, retries) are that split's own, as training
    reports them. ``train.data='memory'`` reads each shard whole before returning (the in-memory baseline).
    """
    splits = split_names(cfg.shard.split_rates)
    shared = make_split_loaders(cfg, manifest, rank, world_size, splits) if share_reader else None
    made: dict[str, ShardLoader] = (
        dict(shared)
        if shared is not None
        else {split: make_split_loader(cfg, manifest, split, rank, world_size) for split in splits}
    )
    if cfg.train.data == "memory":
        for loader in made.values():
            loader.load()
    return SplitLoaders(**made, plan=_plan_counts(made, world_size), shared=shared)


def dataset_loaders(
    cfg: KbitConfig, source: DatasetSource, manifest: Manifest, rank: int, world_size: int
) -> SplitLoaders:
    """The loaders of every split for ``rank`` of ``world_size``, read straight from ``source`` (``train.data:
    direct``; ``manifest`` is its :func:`~kbit_core.data.dataset_reader.dataset_manifest`) through one reader."""
    check_direct(cfg)
    reader = DatasetReader(source, manifest)
    made = {
        split: make_split_loader(cfg, manifest, split, rank, world_size, reader=reader)
        for split in split_names(cfg.shard.split_rates)
    }
    return SplitLoaders(**made, plan=_plan_counts(made, world_size))


def _plan_counts(loaders: dict[str, ShardLoader], world_size: int) -> dict[str, dict[str, int]]:
    """Per split, what one epoch's shard plan reads, drops and pads, plus the train records left past the last
    whole batch (every rank has the same shard size, hence the same tail)."""
    report = next(iter(loaders.values())).plan.report()
    return {
        split: {
            "messages": report[split]["messages"],
            "messages_per_rank": report[split]["messages_per_rank"],
            "dropped_messages": report[split]["dropped"],
            "padded_messages": report[split]["padded"],
            "dropped_tail_records": loader.tail_records * world_size,
        }
        for split, loader in loaders.items()
    }

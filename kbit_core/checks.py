"""Checks before anything is produced: a legal topic name, writable directories, disk space, shard plans that give
every rank data. Each failure is a ConfigError naming the setting; problems that do not stop a run are warnings.

``check_produce`` runs at the start of every produce; :mod:`kbit_core.jobs.preflight` adds what a training run
or a benchmark needs.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.sharding import plan

log = logging.getLogger(__name__)

# Kafka's rule for topic names (kafka.common.internals.Topic): these characters, at most 249, not '.' or '..'.
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_TOPIC_LENGTH = 249
# More CPU ranks per core than this and a run crawls (measured: 64 ranks on 2 cores ran over 300 s without output).
OVERSUBSCRIBED_RANKS_PER_CORE = 4


@dataclass
class Preflight:
    """What the checks found: warnings (also logged), the estimated bytes of one checkpoint, the checkpoint
    ``checkpoint.resume`` resolves to, and the time the checks took."""

    warnings: list[str] = field(default_factory=list)
    checkpoint_bytes: int | None = None
    resume_from: Path | None = None
    seconds: float = 0.0

    def warn(self, message: str) -> None:
        log.warning("preflight: %s", message)
        self.warnings.append(message)


def check_topic_name(topic: str, setting: str = "produce.topic") -> None:
    """ConfigError unless ``topic`` is a legal Kafka topic name."""
    problem = None
    if not topic:
        problem = "is empty"
    elif topic in (".", ".."):
        problem = "cannot be '.' or '..'"
    elif len(topic) > MAX_TOPIC_LENGTH:
        problem = f"has {len(topic)} characters; Kafka allows at most {MAX_TOPIC_LENGTH}"
    elif not _TOPIC_CHARS.match(topic):
        bad = sorted(set(re.sub(r"[A-Za-z0-9._-]", "", topic)))
        problem = f"contains {''.join(bad)!r}; Kafka topic names may hold only letters, digits, '.', '_' and '-'"
    if problem:
        raise ConfigError(f"{setting}={topic!r} is not a legal Kafka topic name: it {problem}")


def check_writable(path: Path, setting: str) -> None:
    """ConfigError unless ``path`` is, or can be created as, a directory this process may write into."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"{setting}={path} cannot be created: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{setting}={path} is not writable: cannot create a file in {existing} ({exc.strerror or exc})"
        ) from None


def check_produce(
    cfg: KbitConfig, topic: str, variant: DataVariant, num_records: int, report: Preflight | None = None
) -> Preflight:
    """What producing ``variant`` of ``num_records`` records into ``topic`` needs; run before the topic is touched."""
    report = report or Preflight()
    check_topic_name(
        topic,
        "produce.topic"
        if topic == cfg.produce.topic
        else f"the topic name derived from produce.topic_prefix={cfg.produce.topic_prefix!r}",
    )
    check_writable(cfg.manifest_dir, "workdir (manifests)")
    if variant.records_per_message > num_records:
        report.warn(
            f"produce.variant.records_per_message={variant.records_per_message} is more than the "
            f"{num_records} records of the dataset: the topic holds a single, partly filled message"
        )
    messages = math.ceil(num_records / variant.records_per_message)
    if cfg.produce.partitions > messages:
        report.warn(
            f"produce.partitions={cfg.produce.partitions} but only {messages} message(s): "
            f"{cfg.produce.partitions - messages} partition(s) stay empty"
        )
    return report


def check_ranks_fit_cores(cfg: KbitConfig, world_size: int, setting: str, report: Preflight) -> None:
    """Warn when ``world_size`` CPU ranks on this machine far outnumber its cores: every rank then gets a sliver of
    a core, and a run that would take seconds takes many minutes with nothing to show for it meanwhile."""
    if cfg.launch.use_gpu or cfg.launch.master.startswith("spark://"):
        return  # GPU ranks, or ranks on a cluster's executors: this machine's cores do not bound them
    cores = len(os.sched_getaffinity(0))
    if world_size > OVERSUBSCRIBED_RANKS_PER_CORE * cores:
        report.warn(
            f"{setting}={world_size} ranks on {cores} CPU core(s) of this machine ({world_size / cores:.0f} per "
            f"core): each rank gets a small share of a core and its start alone takes seconds, so the run takes "
            f"far longer than on fewer ranks; use at most {OVERSUBSCRIBED_RANKS_PER_CORE * cores} here"
        )


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (what a later mkdir -p starts from)."""
    while not path.exists():
        path = path.parent
    return path


def check_shards(
    cfg: KbitConfig,
    num_records: int,
    variant: DataVariant,
    world_size: int,
    batch_size: int,
    snapshot: Any = None,
) -> None:
    """ConfigError when the shard plan of the topic ``cfg`` would produce, or of ``snapshot`` (the Manifest of a
    user's topic), leaves some rank without data."""
    rpm = variant.records_per_message
    messages = math.ceil(num_records / rpm)
    partitions = cfg.produce.partitions
    # Message m goes to partition m % partitions (see kbit_core/produce.py), so this is the layout a manifest will have.
    layout = {p: (0, len(range(p, messages, partitions))) for p in range(partitions)}
    layout = {p: bounds for p, bounds in layout.items() if bounds[1]}
    boundaries = key_runs = None
    if snapshot is not None:
        layout, rpm = snapshot.ranges(), 1
        boundaries, key_runs = snapshot.source.split_offsets, snapshot.source.key_runs
    try:
        shards = plan(
            layout,
            cfg.shard.split_rates,
            world_size,
            remainder=cfg.shard.remainder,
            records_per_message=rpm,
            boundaries=boundaries if cfg.shard.split_by == "time" else None,
            key_runs=key_runs if cfg.shard.split_by == "key_hash" else None,
        ).shards
    except ValueError as exc:
        raise ConfigError(f"cannot plan the shards: {exc}") from None
    where = (
        f"{num_records} records in {messages} message(s) of {rpm}, shard.split_rates={cfg.shard.split_rates}, "
        f"{world_size} rank(s)"
    )
    more = (
        f"snapshot more of topic {snapshot.topic!r} (source.at, source.ranges), move shard.split_times, give more keys"
        if snapshot is not None
        else "produce more records (dataset.num_records), fewer records per message"
    )
    for split, ranks in shards.items():
        if ranks[0].num_messages == 0:
            raise ConfigError(f"split {split!r} gives each rank no message ({where}); {more}, or use fewer ranks")
    per_rank_batch = batch_size // world_size
    train_records = shards["train"][0].num_records
    if train_records < per_rank_batch:
        raise ConfigError(
            f"each rank's train shard holds {train_records} records, less than one batch of "
            f"{per_rank_batch} (train.global_batch_size={batch_size} over {world_size} ranks; {where})"
        )


def check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(nearest_existing(directory)).free
    if needed > free:
        raise ConfigError(f"{what} needs about {needed / 1e6:,.1f} MB but only {free / 1e6:,.1f} MB are free there")

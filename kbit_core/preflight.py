"""Checks on the driver, before anything is produced or launched, that a run can succeed: each failure a ConfigError
naming the setting, in seconds instead of after minutes of producing and launching.

``check_produce`` runs at the start of every produce; ``check_training`` and ``check_benchmark`` add what their
runs need: writable output directories, an importable model that builds for the dataset, shard plans that give
every rank data, and disk space for the checkpoints kept. Problems that do not stop a run (a message grouping more
records than the dataset holds, empty partitions) are returned as warnings and logged.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.errors import ConfigError

if TYPE_CHECKING:
    from kbit_core.datasets import DatasetSource

log = logging.getLogger(__name__)

# Kafka's rule for topic names (kafka.common.internals.Topic): these characters, at most 249, not '.' or '..'.
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_TOPIC_LENGTH = 249

# Optimizer state kept per parameter, in parameter-sized tensors (Adam: two moments; SGD: momentum).
_OPTIMIZER_COPIES = {"adam": 2, "adamw": 2, "sgd": 1}
_FLOAT32_BYTES = 4


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
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"{setting}={path} cannot be created: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"{setting}={path} is not writable: cannot create a file in {existing} "
                          f"({exc.strerror or exc})") from None


def check_produce(cfg: KbitConfig, topic: str, variant: DataVariant, num_records: int,
                  report: Preflight | None = None) -> Preflight:
    """What producing ``variant`` of ``num_records`` records into ``topic`` needs; run before the topic is touched."""
    report = report or Preflight()
    check_topic_name(topic, "produce.topic" if topic == cfg.produce.topic else
                     f"the topic name derived from produce.topic_prefix={cfg.produce.topic_prefix!r}")
    check_writable(cfg.manifest_dir, "workdir (manifests)")
    if variant.records_per_message > num_records:
        report.warn(f"produce.variant.records_per_message={variant.records_per_message} is more than the "
                    f"{num_records} records of the dataset: the topic holds a single, partly filled message")
    messages = math.ceil(num_records / variant.records_per_message)
    if cfg.produce.partitions > messages:
        report.warn(f"produce.partitions={cfg.produce.partitions} but only {messages} message(s): "
                    f"{cfg.produce.partitions - messages} partition(s) stay empty")
    return report


def check_training(cfg: KbitConfig) -> Preflight:
    """Everything ``kbit train`` needs, checked on the driver before producing or launching.

    Raises:
        ConfigError: naming the setting: an illegal topic name, an unwritable workdir or checkpoint.dir, a model
            that does not import or build, a shard plan that leaves a rank without a batch, or too little disk
            for ``checkpoint.keep_last`` checkpoints.
    """
    started = time.perf_counter()
    source = _open_source(cfg)
    report = check_produce(cfg, cfg.produce.topic_for(cfg.dataset), cfg.produce.variant, source.num_records)
    check_writable(cfg.run_dir, "workdir")
    _check_shards(cfg, source.num_records, cfg.produce.variant, cfg.launch.num_processes,
                  cfg.train.global_batch_size)
    num_params = _check_model(cfg, source.image_shape, source.num_classes)
    directory = cfg.run_dir / cfg.checkpoint.dir if cfg.checkpoint.dir is not None else None
    if directory is not None:
        check_writable(directory, "checkpoint.dir")
        report.checkpoint_bytes = _checkpoint_bytes(cfg, num_params)
        _check_space(directory, report.checkpoint_bytes * (cfg.checkpoint.keep_last + 1),
                     f"checkpoint.dir={directory} (checkpoint.keep_last={cfg.checkpoint.keep_last}, plus the one "
                     f"being written, of about {report.checkpoint_bytes / 1e6:,.1f} MB each)")
    from kbit_core.train.checkpoint import resolve_resume  # imports torch, as the model check just did

    # A resume path that is no checkpoint, or resume=latest without checkpoint.dir, fails here; latest logs which
    # lineage it continues.
    report.resume_from = resolve_resume(cfg, directory, cfg.run_dir)
    report.seconds = time.perf_counter() - started
    return report


def check_benchmark(cfg: KbitConfig) -> Preflight:
    """Everything ``kbit bench`` needs for its whole matrix, checked on the driver before producing or launching.

    Raises:
        ConfigError: naming the setting (see :func:`check_training`), for the first variant, batch size or world
            size of the matrix that cannot run.
    """
    started = time.perf_counter()
    source = _open_source(cfg)
    report = Preflight()
    for variant in cfg.bench.variants:
        check_produce(cfg, cfg.produce.topic_for(cfg.dataset, variant), variant, source.num_records, report)
    check_writable(cfg.run_dir, "workdir")
    check_writable(cfg.bench.output_dir.resolve(), "bench.output_dir")
    for world_size in cfg.bench.world_sizes or [cfg.launch.num_processes]:
        for batch_size in cfg.bench.batch_sizes or [cfg.train.global_batch_size]:
            for variant in {v.records_per_message: v for v in cfg.bench.variants}.values():
                _check_shards(cfg, source.num_records, variant, world_size, batch_size)
    if cfg.bench.train_epoch:
        _check_model(cfg, source.image_shape, source.num_classes)
    report.seconds = time.perf_counter() - started
    return report


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (what a later mkdir -p starts from)."""
    while not path.exists():
        path = path.parent
    return path


def _open_source(cfg: KbitConfig) -> DatasetSource:
    from kbit_core.datasets import open_source  # lazily: the sources pull in numpy and the IDX reader

    return open_source(cfg.dataset)


def _check_shards(cfg: KbitConfig, num_records: int, variant: DataVariant, world_size: int, batch_size: int) -> None:
    """ConfigError when the shard plan of the topic ``cfg`` would produce leaves some rank without data."""
    from kbit_core.sharding import plan

    rpm = variant.records_per_message
    messages = math.ceil(num_records / rpm)
    partitions = cfg.produce.partitions
    # Message m goes to partition m % partitions (see kafka/producer.py), so this is the layout a manifest will have.
    layout = {p: (0, len(range(p, messages, partitions))) for p in range(partitions)}
    layout = {p: bounds for p, bounds in layout.items() if bounds[1]}
    shards = plan(layout, cfg.shard.split_rates, world_size, remainder=cfg.shard.remainder,
                  records_per_message=rpm).shards
    where = (f"{num_records} records in {messages} message(s) of {rpm}, shard.split_rates={cfg.shard.split_rates}, "
             f"{world_size} rank(s)")
    for split, ranks in shards.items():
        if ranks[0].num_messages == 0:
            raise ConfigError(f"split {split!r} gives each rank no message ({where}); produce more records "
                              "(dataset.num_records), fewer records per message, or use fewer ranks")
    per_rank_batch = batch_size // world_size
    train_records = shards["train"][0].num_records
    if train_records < per_rank_batch:
        raise ConfigError(f"each rank's train shard holds {train_records} records, less than one batch of "
                          f"{per_rank_batch} (train.global_batch_size={batch_size} over {world_size} ranks; {where})")


@contextmanager
def _worker_import_path() -> Iterator[None]:
    """sys.path extended by PYTHONPATH: the ranks inherit the driver's environment, so they import from there too."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path.extend(extra)
    try:
        yield
    finally:
        for entry in extra:
            sys.path.remove(entry)


def _check_model(cfg: KbitConfig, image_shape: Sequence[int], num_classes: int) -> int:
    """Import and build ``train.model`` for the dataset's images as every rank will; its number of parameters."""
    from kbit_core.train.models import build_model

    with _worker_import_path():
        model = build_model(cfg.train.model, tuple(image_shape), num_classes)
    return sum(p.numel() for p in model.parameters())


def _checkpoint_bytes(cfg: KbitConfig, num_params: int) -> int:
    """A checkpoint's approximate size: fp32 weights, the optimizer's per-parameter state and an EMA copy."""
    optim = cfg.train.optim
    copies = 1 + _OPTIMIZER_COPIES[optim.name] - (optim.name == "sgd" and optim.momentum == 0)
    copies += cfg.train.ema_decay is not None
    return num_params * _FLOAT32_BYTES * copies


def _check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(_nearest_existing(directory)).free
    if needed > free:
        raise ConfigError(f"{what} needs about {needed / 1e6:,.1f} MB but only {free / 1e6:,.1f} MB are free there")

"""Checks on the driver, before anything is produced or launched, that a training run or a benchmark can succeed:
each failure a ConfigError naming the setting, in seconds instead of after minutes of producing and launching.

On top of :mod:`kbit_core.checks` (topic names, writable directories, shard plans): an importable model that
builds for the dataset, a map-style dataset whose first and last items fit and whose ratio splits give validation
and test the training split's classes (a warning), and disk space for the checkpoints kept.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kbit_core.checks import (
    Preflight,
    check_produce,
    check_ranks_fit_cores,
    check_shards,
    check_space,
    check_writable,
)
from kbit_core.config import KbitConfig
from kbit_core.data.dataset_reader import check_direct
from kbit_core.datasets import DatasetSource, open_source
from kbit_core.datasets.map_style import MapStyleSource
from kbit_core.errors import ConfigError
from kbit_core.jobs.split_check import split_label_mismatch
from kbit_core.kafka.manifest import DatasetInfo
from kbit_core.topic_dataset import snapshot_dataset
from kbit_core.train.checkpoint import resolve_resume
from kbit_core.train.models import build_model, check_vocabulary
from kbit_core.train.tensor_parallel import splittable_blocks
from kbit_core.train.user_code import resolve_all

log = logging.getLogger(__name__)

# Optimizer state kept per parameter, in parameter-sized tensors (Adam: two moments; SGD: momentum).
_OPTIMIZER_COPIES = {"adam": 2, "adamw": 2, "sgd": 1}
_FLOAT32_BYTES = 4


def check_training(cfg: KbitConfig) -> Preflight:
    """Everything ``kbit train`` needs, checked on the driver before producing or launching.

    Raises:
        ConfigError: naming the setting: an illegal topic name, an unwritable workdir or checkpoint.dir, a model
            that does not import or build, a loss, metric, optimizer or scheduler path that does not import, a shard plan that leaves a rank without a batch, or too little disk
            for ``checkpoint.keep_last`` checkpoints.
    """
    started = time.perf_counter()
    check_writable(cfg.run_dir, "workdir")
    if cfg.source.topic is not None and cfg.train.mode == "continuous":
        # a user's stream: nothing to snapshot yet (its held-out records are, when they exist), no shards to plan
        source: DatasetSource | DatasetInfo = user_stream_records(cfg)
        report, planned, layout = Preflight(), cfg, None
    elif cfg.source.topic is not None:  # a user's topic: its snapshot, mapping checked, is the dataset
        snapshot = snapshot_dataset(cfg)
        source = snapshot.dataset
        report, planned, layout = Preflight(), cfg, snapshot
    else:
        with _worker_import_path():  # a dataset factory imports as on the ranks
            source = open_source(cfg.dataset, exact=cfg.train.data == "direct")
        if isinstance(source, MapStyleSource):
            source.check_ends()
        layout = None
    if cfg.train.data == "direct":  # no topic: the dataset is planned as one partition of its records
        check_direct(cfg)
        report, planned = Preflight(), cfg.override({"produce.partitions": 1, "produce.variant.records_per_message": 1})
    elif layout is None and cfg.source.topic is None:
        report = check_produce(cfg, cfg.produce.topic_for(cfg.dataset), cfg.produce.variant, source.num_records)
        planned = cfg
    if cfg.source.topic is None or cfg.train.mode == "batch":
        # Under a pipeline or tensor parallelism one process per data-parallel rank reads: the shards are planned
        # for those.
        check_shards(
            planned,
            source.num_records,
            planned.produce.variant,
            cfg.data_parallel_size,
            cfg.train.global_batch_size,
            layout,
        )
    if isinstance(source, MapStyleSource) and (mismatch := split_label_mismatch(planned, source)):
        report.warn(mismatch)
    check_ranks_fit_cores(cfg, cfg.launch.num_processes, "launch.num_processes", report)
    num_params = _check_model(cfg, source)
    directory = cfg.run_dir / cfg.checkpoint.dir if cfg.checkpoint.dir is not None else None
    if directory is not None:
        check_writable(directory, "checkpoint.dir")
        report.checkpoint_bytes = _checkpoint_bytes(cfg, num_params)
        check_space(
            directory,
            report.checkpoint_bytes * (cfg.checkpoint.keep_last + 1),
            f"checkpoint.dir={directory} (checkpoint.keep_last={cfg.checkpoint.keep_last}, plus the one "
            f"being written, of about {report.checkpoint_bytes / 1e6:,.1f} MB each)",
        )
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
    source = open_source(cfg.dataset)
    report = Preflight()
    for variant in cfg.bench.matrix_variants():
        check_produce(cfg, cfg.produce.topic_for(cfg.dataset, variant), variant, source.num_records, report)
    check_writable(cfg.run_dir, "workdir")
    check_writable(cfg.bench.output_dir.resolve(), "bench.output_dir")
    for world_size in cfg.bench.world_sizes or [cfg.launch.num_processes]:
        setting = "bench.world_sizes" if cfg.bench.world_sizes else "launch.num_processes"
        check_ranks_fit_cores(cfg, world_size, setting, report)
        for batch_size in cfg.bench.batch_sizes or [cfg.train.global_batch_size]:
            for variant in {v.records_per_message: v for v in cfg.bench.matrix_variants()}.values():
                check_shards(cfg, source.num_records, variant, world_size, batch_size)
    if cfg.bench.train_epoch:
        _check_model(cfg, source)
    report.seconds = time.perf_counter() - started
    return report


def user_stream_records(cfg: KbitConfig) -> DatasetInfo:
    """What a stream of ``source.topic`` holds, from its mapping alone: its labels cannot be discovered in advance,
    so the mapping names them (``vocabulary`` or ``num_classes``)."""
    mapping = cfg.source.mapping
    assert mapping is not None
    classes = mapping.num_classes or (len(mapping.vocabulary) if mapping.vocabulary is not None else None)
    if classes is None:
        raise ConfigError(
            f"train.mode=continuous on source.topic {cfg.source.topic!r} needs source.mapping.vocabulary (string "
            "labels) or source.mapping.num_classes (integer labels): a stream's labels cannot be discovered in advance"
        )
    return DatasetInfo(
        name=f"topic {cfg.source.topic}",
        seed=0,
        num_records=cfg.stream.eval_records,
        image_shape=mapping.record_shape,
        num_classes=classes,
        record_dtype=mapping.dtype,
    )


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


def _check_model(cfg: KbitConfig, source: DatasetSource | DatasetInfo) -> int:
    """Import and build ``train.model`` for the dataset's records as every rank will (for token sequences, with an
    embedding that holds the dataset's vocabulary), and import the loss, metrics,
    optimizer and scheduler named by import path, and check that tensor parallelism can split the model; the
    model's number of parameters."""
    with _worker_import_path():
        model = build_model(cfg.train.model, tuple(source.image_shape), source.num_classes)
        if source.vocab_size is not None:
            check_vocabulary(model, source.vocab_size)
        resolve_all(cfg.train)
    if cfg.train.tensor_parallel.size > 1:
        splittable_blocks(model, cfg.train.tensor_parallel.size)
    return sum(p.numel() for p in model.parameters())


def _checkpoint_bytes(cfg: KbitConfig, num_params: int) -> int:
    """A checkpoint's approximate size: fp32 weights, the optimizer's per-parameter state and an EMA copy."""
    optim = cfg.train.optim
    # A user optimizer's state is unknown before it runs: counted as Adam's.
    copies = 1 + _OPTIMIZER_COPIES.get(optim.name, 2) - (optim.name == "sgd" and optim.momentum == 0)
    copies += cfg.train.ema_decay is not None
    return num_params * _FLOAT32_BYTES * copies

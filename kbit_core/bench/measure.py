"""Worker side of the benchmark: on every rank, time loading each configuration's shard from Kafka.

One call of :func:`measure_iteration` is one benchmark iteration (one TorchDistributor job). For each
configuration, in the order the driver chose, every rank waits at a barrier, then starts the clock and
builds eager loaders for train/val/test, reads and decodes its whole shard, and cuts it into tensor
batches; the clock stops when all three splits are ready (the original's "data loading time"). Stages:

* ``connect``: everything in the timed region that is neither fetch, decode nor collate: building the
  loaders (codec, shard plan) and checking the planned ranges against the broker's offsets (metadata and
  ListOffsets round trips on fresh connections). The consumer's own connection happens on its first poll
  and is counted in ``fetch``.
* ``fetch``: polling the planned offset ranges (client decompression included), as the reader counts it.
* ``decode``: codec decode of the message values into arrays.
* ``collate``: permuting, cutting and converting the decoded arrays into the loaders' torch batches.

``bytes`` are the message values received (after the client decompressed them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

STAGES: tuple[str, ...] = ("connect", "fetch", "decode", "collate")
SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass(frozen=True)
class Sample:
    """One rank's measurement of one configuration in one iteration: one row of the raw timings CSV.

    ``iteration`` counts measured iterations from 0; warm-ups are numbered -warmup..-1. ``makespan``
    marks the rank whose ``load_s`` was the slowest of its run (the straggler the makespan view reports).
    """

    iteration: int
    warmup: bool
    config: str
    format: str
    layout: str
    compression: str
    records_per_message: int
    client: str
    batch_size: int
    world_size: int
    rank: int
    order_position: int
    connect_s: float
    fetch_s: float
    decode_s: float
    collate_s: float
    load_s: float
    records: int
    bytes: int
    train_epoch_s: float
    train_samples_per_s: float
    makespan: bool


SAMPLE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Sample))


@dataclass(frozen=True)
class Task:
    """One configuration as the driver hands it to the workers (plain values: it crosses cloudpickle)."""

    config: str
    client: str
    batch_size: int
    manifest_json: str


def cell_config(base: Mapping[str, Any], task: Task) -> Any:
    """The KbitConfig one configuration runs with: eager reader, its client and its global batch size."""
    from kbit_core.config import KbitConfig, deep_merge

    return KbitConfig.from_dict(deep_merge(dict(base), {
        "reader": {"mode": "eager"}, "kafka": {"client": task.client},
        "train": {"global_batch_size": task.batch_size}}))


def measure_iteration(config: dict[str, Any], tasks: list[Task], iteration: int, warmup: bool,
                      train_epoch: bool) -> list[dict[str, Any]]:
    """Run every task in the given order on this rank; return all ranks' :class:`Sample` rows (on every rank).

    Args:
        config: ``KbitConfig.to_secret_dict()`` of the benchmark (secrets revealed: this runs inside the job).
        tasks: The configurations in this iteration's (shuffled) order.
        iteration: Iteration number recorded in the rows (negative for warm-ups).
        warmup: Whether the rows are warm-up rows, excluded from the statistics.
        train_epoch: Also time one DDP training epoch over each configuration's train split.
    """
    from kbit_core.config import KbitConfig
    from kbit_core.train.distributed import all_gather, init_process_group, read_env, teardown

    base = KbitConfig.from_dict(config)
    env = read_env(base.launch.use_gpu)
    init_process_group(env, base.launch.timeout_s)
    rows: list[dict[str, Any]] = []
    for position, task in enumerate(tasks):
        mine = _measure_task(config, task, env, train_epoch)
        gathered = all_gather(mine, env)
        slowest = max(range(len(gathered)), key=lambda r: gathered[r]["load_s"])
        for rank, numbers in enumerate(gathered):
            rows.append(asdict(Sample(iteration=iteration, warmup=warmup, order_position=position, rank=rank,
                                      world_size=env.world_size, makespan=rank == slowest, **numbers)))
    teardown()
    return rows


def _measure_task(config: Mapping[str, Any], task: Task, env: Any, train_epoch: bool) -> dict[str, Any]:
    """This rank's numbers for one configuration (the Sample fields that do not describe the run)."""
    import gc

    import torch.distributed as dist

    from kbit_core.data.loader import make_split_loader
    from kbit_core.kafka.manifest import Manifest

    cfg = cell_config(config, task)
    manifest = Manifest.model_validate_json(task.manifest_json)
    splits = SPLITS[: len(cfg.shard.split_rates)]
    dist.barrier()
    start = time.perf_counter()
    loaders = [make_split_loader(cfg, manifest, split, env.rank, env.world_size, client=task.client)
               for split in splits]
    collate = 0.0
    for loader in loaders:
        loader.load()
        t0 = time.perf_counter()
        for _ in loader:
            pass
        collate += time.perf_counter() - t0
    load = time.perf_counter() - start
    fetch = sum(ld.stats.reader.fetch_seconds for ld in loaders)
    decode = sum(ld.stats.reader.decode_seconds for ld in loaders)
    variant = manifest.variant
    numbers = {
        "config": task.config, "format": variant.format, "layout": variant.layout,
        "compression": variant.compression, "records_per_message": variant.records_per_message,
        "client": task.client, "batch_size": task.batch_size,
        "connect_s": max(0.0, load - fetch - decode - collate), "fetch_s": fetch, "decode_s": decode,
        "collate_s": collate, "load_s": load,
        "records": sum(ld.stats.reader.records for ld in loaders),
        "bytes": sum(ld.stats.reader.bytes for ld in loaders),
        "train_epoch_s": float("nan"), "train_samples_per_s": float("nan"),
    }
    if train_epoch:
        numbers["train_epoch_s"], numbers["train_samples_per_s"] = _train_one_epoch(cfg, env, manifest, loaders[0])
    for loader in loaders:
        loader.close()
    del loaders
    gc.collect()
    return numbers


def _train_one_epoch(cfg: Any, env: Any, manifest: Any, train_loader: Any) -> tuple[float, float]:
    """Seconds and global samples/s of one DDP epoch over the already loaded train split."""
    import torch
    import torch.distributed as dist

    from kbit_core.train.engine import build_engine
    from kbit_core.train.loop import SplitLoaders, Trainer, steps_per_epoch
    from kbit_core.train.models import build_model

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.train.model, tuple(manifest.dataset.image_shape), manifest.dataset.num_classes)
    per_epoch = steps_per_epoch(cfg, len(train_loader))
    engine = build_engine(model, cfg, env, per_epoch, per_epoch, None)
    trainer = Trainer(cfg, env, engine, SplitLoaders(train=train_loader), None)
    dist.barrier()
    start = time.perf_counter()
    metrics = trainer.train_epoch(0)
    seconds = time.perf_counter() - start
    # The engine holds the DDP wrapper: it must be gone before the process group is torn down.
    del trainer, engine, model
    return seconds, float(metrics["samples_per_s"])

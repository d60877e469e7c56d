"""Worker side of the benchmark: on every rank, time loading each configuration's shard from Kafka.

One call of :func:`measure_iteration` is one benchmark iteration (one TorchDistributor job). For each
configuration, in the order the driver chose, every rank waits at a barrier, then starts the clock and
builds eager loaders for train/val/test over one shared reader, reads and decodes its whole shard, and cuts
it into tensor batches; the clock stops when all three splits are ready (the original's "data loading
time"). Stages, each timed where it happens:

* ``connect``: creating the rank's one consumer and checking every split's planned ranges against the
  broker's offsets through it in one bounds query (metadata, and one fetch where each partition's planned
  offsets end, which also connects the consumer to the partition leaders).
* ``fetch``: polling the planned offset ranges (client decompression included), as the reader counts it.
* ``decode``: codec decode of the message values into arrays.
* ``collate``: permuting, cutting and converting the decoded arrays into the loaders' torch batches.
* ``other``: the rest of the timed region, measured as ``load`` minus the stages above: building the codec
  and the shard plans, and the bookkeeping between stages.

``bytes`` are the message values received (after the client decompressed them). The counters say what the
rank did not read exactly once: corrupt messages skipped, offsets missing inside planned ranges, messages
the plan repeats or drops to even the ranks out, records the loader repeated to keep ``len()``; and
``kafka_clients`` counts the Kafka clients the rank opened for the configuration.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from kbit_core.config import LOOPBACK, KbitConfig
from kbit_core.kafka.manifest import Manifest
from kbit_core.train.distributed import all_gather, init_process_group, read_env, teardown
from kbit_core.train.engine_factory import build_engine
from kbit_core.train.loop import SplitLoaders, Trainer, steps_per_epoch
from kbit_core.train.models import build_model
from kbit_core.train.rank_data import rank_loaders

STAGES: tuple[str, ...] = ("connect", "fetch", "decode", "collate", "other")
COUNTERS: tuple[str, ...] = (
    "skipped_messages",
    "gap_offsets",
    "padded_messages",
    "padded_records",
    "dropped_messages",
    "kafka_clients",
)


@dataclass(frozen=True)
class Sample:
    """One rank's measurement of one configuration in one iteration: one row of the raw timings CSV.

    ``iteration`` counts measured iterations from 0; warm-ups are numbered -warmup..-1.
    """

    iteration: int
    warmup: bool
    config: str
    format: str
    layout: str
    compression: str
    records_per_message: int
    client: str
    decoder: str  # reader.decoder: kbit's fast path or the format's stock library
    network: str  # the network profile of the bed's links (bench.networks), loopback when not shaped
    batch_size: int
    world_size: int
    rank: int
    order_position: int
    connect_s: float
    fetch_s: float
    decode_s: float
    collate_s: float
    other_s: float
    load_s: float
    records: int
    bytes: int
    skipped_messages: int  # corrupt messages left out (reader.bad_records='skip')
    gap_offsets: int  # offsets missing inside the planned ranges
    padded_messages: int  # messages this rank reads twice so ranks even out (shard.remainder='pad')
    padded_records: int  # records the loaders repeated to keep len() after skips
    dropped_messages: int  # messages of the splits that no rank reads (shard.remainder='drop'), all splits
    kafka_clients: int  # Kafka clients this rank opened for the configuration
    train_epoch_s: float
    train_samples_per_s: float
    started_unix_s: float  # wall clock when this rank's timed region began (after the barrier)
    finished_unix_s: float  # wall clock when it ended
    is_slowest_rank: bool  # this rank's load_s is its run's makespan (the straggler a synchronous job waits for)


SAMPLE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Sample))


@dataclass(frozen=True)
class Task:
    """One configuration as the driver hands it to the workers (as a plain dict: it is handed off to other processes)."""

    config: str
    client: str
    batch_size: int
    manifest_json: str
    decoder: str = "fast"
    network: str = LOOPBACK  # the network profile the bed's links were shaped to (bench.networks)


def cell_config(base: KbitConfig, task: Task) -> KbitConfig:
    """The KbitConfig one configuration runs with: eager reader, its client, decoder and global batch size."""
    return base.override(
        {
            "reader.mode": "eager",
            "reader.decoder": task.decoder,
            "kafka.client": task.client,
            "train.global_batch_size": task.batch_size,
        }
    )


def measure_iteration(
    cfg: KbitConfig, tasks: list[dict[str, Any]], iteration: int, warmup: bool, train_epoch: bool
) -> list[dict[str, Any]]:
    """Run every task in the given order on this rank; return all ranks' :class:`Sample` rows (on every rank).

    Args:
        cfg: The benchmark's config.
        tasks: The configurations (:class:`Task` fields) in this iteration's (shuffled) order.
        iteration: Iteration number recorded in the rows (negative for warm-ups).
        warmup: Whether the rows are warm-up rows, excluded from the statistics.
        train_epoch: Also time one DDP training epoch over each configuration's train split.
    """
    env = read_env(cfg.launch.use_gpu)
    init_process_group(env, cfg.launch.timeout_s)
    rows: list[dict[str, Any]] = []
    for position, task in enumerate(Task(**t) for t in tasks):
        mine = _measure_task(cfg, task, env, train_epoch)
        gathered = all_gather(mine, env)
        slowest = max(range(len(gathered)), key=lambda r: gathered[r]["load_s"])
        for rank, numbers in enumerate(gathered):
            rows.append(
                asdict(
                    Sample(
                        iteration=iteration,
                        warmup=warmup,
                        order_position=position,
                        rank=rank,
                        world_size=env.world_size,
                        is_slowest_rank=rank == slowest,
                        **numbers,
                    )
                )
            )
    teardown()
    return rows


def _measure_task(base: KbitConfig, task: Task, env: Any, train_epoch: bool) -> dict[str, Any]:
    """This rank's numbers for one configuration (the Sample fields that do not describe the run)."""
    # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
    import torch.distributed as dist

    cfg = cell_config(base, task)
    manifest = Manifest.model_validate_json(task.manifest_json)
    dist.barrier()
    numbers, loaders = time_loading(cfg, manifest, env.rank, env.world_size)
    variant = manifest.variant
    numbers.update(
        {
            "config": task.config,
            "format": variant.format,
            "layout": variant.layout,
            "compression": variant.compression,
            "records_per_message": variant.records_per_message,
            "client": task.client,
            "decoder": task.decoder,
            "network": task.network,
            "batch_size": task.batch_size,
            "train_epoch_s": float("nan"),
            "train_samples_per_s": float("nan"),
        }
    )
    try:
        if train_epoch:
            numbers["train_epoch_s"], numbers["train_samples_per_s"] = _train_one_epoch(
                cfg, env, manifest, loaders.train
            )
    finally:
        loaders.close()
    del loaders
    gc.collect()
    return numbers


def time_loading(cfg: KbitConfig, manifest: Any, rank: int, world_size: int) -> tuple[dict[str, Any], SplitLoaders]:
    """The timed region of one configuration on one rank: stage seconds, ``load_s``, records, bytes and
    counters, and the loaded (still open) loaders, sharing one reader, for the caller to use and close."""
    started_unix_s, start = time.time(), time.perf_counter()
    loaders = rank_loaders(cfg, manifest, rank, world_size, share_reader=True)
    try:
        t0 = time.perf_counter()
        loaders.shared.connect()
        connect = time.perf_counter() - t0
        collate = 0.0
        for loader in loaders.splits().values():
            loader.load()
            t0 = time.perf_counter()
            for _ in loader:
                pass
            collate += time.perf_counter() - t0
        load = time.perf_counter() - start
    except BaseException:
        loaders.close()
        raise
    read = loaders.shared.reader.stats
    shards = [loader.shard for loader in loaders.splits().values()]
    measured = {
        "connect_s": connect,
        "fetch_s": read.fetch_seconds,
        "decode_s": read.decode_seconds,
        "collate_s": collate,
    }
    return {
        **measured,
        "other_s": max(0.0, load - sum(measured.values())),
        "load_s": load,
        "started_unix_s": started_unix_s,
        "finished_unix_s": started_unix_s + load,
        "records": read.records,
        "bytes": read.bytes,
        "skipped_messages": read.skipped,
        "gap_offsets": read.gaps,
        "padded_messages": sum(s.padded for s in shards),
        "padded_records": sum(loader.stats.padded_records for loader in loaders.splits().values()),
        "dropped_messages": sum(s.dropped for s in shards),
        "kafka_clients": read.kafka_clients,
    }, loaders


def _train_one_epoch(cfg: Any, env: Any, manifest: Any, train_loader: Any) -> tuple[float, float]:
    """Seconds and global samples/s of one DDP epoch over the already loaded train split."""
    # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
    import torch
    import torch.distributed as dist

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

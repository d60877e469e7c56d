"""The per-rank entry point that TorchDistributor (or torchrun) runs: set up, train, return one result everywhere."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kbit_core.config import KbitConfig
from kbit_core.kafka.manifest import Manifest
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import (
    DistEnv,
    all_gather,
    import_deepspeed,
    init_process_group,
    rank_identity,
    read_env,
    seed_everything,
    teardown,
)
from kbit_core.train.engine_factory import build_engine
from kbit_core.train.layout import LoaderFactory, layout_loaders
from kbit_core.train.loop import SplitLoaders, Trainer, steps_per_epoch
from kbit_core.train.models import ImageShape, build_model
from kbit_core.train.rank_data import rank_loaders

RESULT_FILE = "train_result.json"


def train_main(cfg: KbitConfig, manifest_json: str, run_dir: str) -> dict[str, Any]:
    """Train on the Kafka topic described by ``manifest_json``; the same dict returns on every rank.

    Args:
        cfg: The run's config, as :func:`kbit_core.launch.distributor.run_distributed` hands it to each rank.
        manifest_json: The produce run's manifest (topic, partitions, offsets, image shape, classes) as JSON,
            passed inline because executors on other hosts cannot read the driver's files.
        run_dir: Directory for this run's outputs (checkpoints, errors/rank*.txt); relative checkpoint paths
            are resolved against it. Every rank writes there, so a multi-host run needs it on a shared filesystem.
    """
    manifest = Manifest.model_validate_json(manifest_json)
    if cfg.train.data == "memory":
        # The in-memory baseline: each rank reads its whole shard before training starts.
        cfg = cfg.override({"reader.mode": "eager"})

    def kafka_loaders(cfg: KbitConfig, env: DistEnv) -> SplitLoaders:
        return rank_loaders(cfg, manifest, env.rank, env.world_size, share_reader=False)

    return run_worker(cfg, run_dir, kafka_loaders, manifest.dataset.image_shape, manifest.dataset.num_classes)


def run_worker(
    cfg: KbitConfig,
    run_dir: str | Path,
    make_loaders: LoaderFactory,
    image_shape: ImageShape,
    num_classes: int,
    trainer_type: type[Trainer] = Trainer,
) -> dict[str, Any]:
    """Join the process group, train with the loaders ``make_loaders`` builds, leave cleanly.

    ``train_main`` calls it with Kafka loaders; any other source of (x, y) batches with the ShardLoader
    interface trains the same way. ``trainer_type`` runs the loop (the continuous trainer passes its own).
    """
    env = read_env(cfg.launch.use_gpu)
    deepspeed = import_deepspeed(env.device) if cfg.deepspeed.enabled else None
    init_process_group(env, cfg.launch.timeout_s, deepspeed)
    # Model, wrapper and optimizer live only inside _train, so they are freed before the group is destroyed.
    result = _train(cfg, env, deepspeed, Path(run_dir), make_loaders, image_shape, num_classes, trainer_type)
    teardown()
    return result


def _train(
    cfg: KbitConfig,
    env: DistEnv,
    deepspeed: ModuleType | None,
    run_dir: Path,
    make_loaders: LoaderFactory,
    image_shape: ImageShape,
    num_classes: int,
    trainer_type: type[Trainer],
) -> dict[str, Any]:
    loaders = layout_loaders(cfg, env, make_loaders)
    try:
        return _fit(cfg, env, deepspeed, run_dir, loaders, image_shape, num_classes, trainer_type)
    finally:
        loaders.close()


def _fit(
    cfg: KbitConfig,
    env: DistEnv,
    deepspeed: ModuleType | None,
    run_dir: Path,
    loaders: SplitLoaders,
    image_shape: ImageShape,
    num_classes: int,
    trainer_type: type[Trainer],
) -> dict[str, Any]:
    # The same seed on every rank gives identical initial weights; then each rank gets its own stream.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.train.model, image_shape, num_classes)
    seed_everything(cfg.train.seed, env.rank, cfg.train.deterministic, env.device)
    per_epoch = steps_per_epoch(cfg, len(loaders.train))
    engine = build_engine(model, cfg, env, per_epoch, per_epoch * cfg.train.epochs, deepspeed)

    writer, resume_from = ckpt.open_lineage(cfg, run_dir, env.is_main, sharded=deepspeed is not None)
    trainer = trainer_type(cfg, env, engine, loaders, writer)
    if resume_from is not None:
        trainer.resume(resume_from)
    result = {**trainer.fit(), "ranks": all_gather(rank_identity(env), env)}
    if writer is not None:
        writer.finish()
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    return result

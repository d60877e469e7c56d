"""The continuous training job: check the stream, produce the held-out topic (or, on a user's topic, snapshot its
held-out records), launch, restart, stop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError, TopicError
from kbit_core.jobs.restarts import train_with_restarts
from kbit_core.jobs.user_stream import heldout_snapshot, user_stream_config
from kbit_core.kafka import admin, ownership
from kbit_core.kafka.manifest import Manifest
from kbit_core.produce import produce_dataset
from kbit_core.stream.ledger import assign_partitions
from kbit_core.stream.stream_log import stream_log_path
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.stream_trainer import stop_file_path
from kbit_core.train.stream_worker import heldout_config, stream_main

log = logging.getLogger(__name__)


def check_continuous(cfg: KbitConfig) -> None:
    """What continuous training needs that the config model alone cannot check; each failure names the setting."""
    if cfg.train.grad_accum_steps != 1:
        raise ConfigError("train.mode=continuous steps on every batch that arrives: set train.grad_accum_steps=1")
    if cfg.source.topic is None and cfg.produce.variant.records_per_message != 1:
        raise ConfigError("train.mode=continuous needs produce.variant.records_per_message=1 (the stream's form)")
    if cfg.train.data != "kafka":
        raise ConfigError("train.mode=continuous reads the live topic: train.data must be 'kafka'")
    if cfg.kafka.client != "confluent":
        raise ConfigError(
            "train.mode=continuous reads with the confluent client (kafka.client=confluent): it needs "
            "each fetch's high watermark for the lag"
        )
    assign_partitions(cfg.produce.partitions, cfg.launch.num_processes)


def wait_for_stream(cfg: KbitConfig) -> str:
    """The stream topic, once it exists (a producer may still be starting); TopicError after stream.idle_timeout_s."""
    topic = cfg.stream.topic_for(cfg.dataset, cfg.produce)
    advice = "start `kbit produce --stream` with the same config"
    admin.wait_for_topic(cfg.kafka, topic, cfg.stream.idle_timeout_s, "stream topic", advice)
    if ownership.kbit_evidence(cfg.kafka, cfg.workdir, topic, [stream_log_path(cfg.workdir, topic)]) is None:
        raise TopicError(
            f"stream topic {topic!r} was not written by kbit's live producer (no stream log at "
            f"{stream_log_path(cfg.workdir, topic)}): its keys are not kbit's stream indices and kbit will not write "
            f"a held-out topic beside it; train on it as a user's topic instead: source.topic={topic} with a "
            "source.mapping (docs/your_topics.md)"
        )
    partitions = admin.topic_partitions(cfg.kafka, topic)
    if len(partitions) != cfg.produce.partitions:
        raise TopicError(
            f"stream topic {topic!r} has {len(partitions)} partitions; produce.partitions={cfg.produce.partitions}"
        )
    return topic


def continue_from(cfg: KbitConfig) -> KbitConfig:
    """``stream.start=checkpoint`` without an explicit ``checkpoint.resume``: resume the newest checkpoint of this
    stream's newest lineage, finished or not (a stopped stream run is continued, not retrained), under any world
    size (continuous lineages leave launch.num_processes out)."""
    if cfg.stream.start != "checkpoint" or cfg.checkpoint.resume != "none" or cfg.checkpoint.dir is None:
        return cfg
    wanted = ckpt.lineage_settings(cfg)
    for lineage in reversed(ckpt.list_lineages(cfg.run_dir / cfg.checkpoint.dir)):
        saved = ckpt.read_lineage(lineage)["settings"]
        checkpoints = ckpt.list_checkpoints(lineage)
        if checkpoints and all(saved.get(key) == value for key, value in wanted.items()):
            log.warning("continuing the stream from %s", checkpoints[-1])
            return cfg.resuming(checkpoints[-1])
    return cfg


def train_continuous(cfg: KbitConfig, run_id: str | None, *, progress: bool = True) -> dict[str, Any]:
    """Train on the live stream until a stop condition; the ranks' result plus driver facts.

    Any exception reaching the driver while the ranks run (a Prefect cancellation, Ctrl-C) drops the stop file
    first, so the ranks stop at their next step with a final checkpoint instead of dying mid-step.
    """
    if cfg.source.topic is not None:
        return _train_user_topic(cfg, run_id)
    check_continuous(cfg)
    cfg = continue_from(cfg)
    topic = wait_for_stream(cfg)
    heldout_cfg = heldout_config(cfg)
    heldout = produce_dataset(heldout_cfg, progress=progress)
    # A restart after a broker crash finds the held-out topic gone: it is produced again, at the same offsets.
    result = _launch(cfg, heldout, before_restart=lambda: produce_dataset(heldout_cfg, progress=False))
    return {
        **result,
        "topic": topic,
        "heldout_topic": heldout.topic,
        "mlflow_run_id": run_id,
        "stream_manifest": str(stream_log_path(cfg.workdir, topic)),
    }


def _train_user_topic(cfg: KbitConfig, run_id: str | None) -> dict[str, Any]:
    """Continuous training on ``source.topic``, a topic kbit did not write: its first ``stream.eval_records`` records
    are held out (a snapshot, nothing created), the stream trains on every later one, indexed by offset."""
    cfg = user_stream_config(cfg)
    check_continuous(cfg)
    cfg = continue_from(cfg)
    heldout = heldout_snapshot(cfg)
    result = _launch(cfg, heldout)
    return {**result, "topic": cfg.source.topic, "heldout_records": heldout.num_records, "mlflow_run_id": run_id}


def _launch(cfg: KbitConfig, heldout: Manifest, before_restart: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """Run the stream ranks with ``heldout``'s halves for evaluation. Any exception reaching the driver while they
    run drops the stop file first (see :func:`train_continuous`)."""
    stop_file = stop_file_path(cfg)
    stop_file.unlink(missing_ok=True)  # a request to an earlier run
    try:
        return train_with_restarts(cfg, stream_main, heldout.model_dump_json(), before_restart=before_restart)
    except BaseException:
        stop_file.parent.mkdir(parents=True, exist_ok=True)
        stop_file.write_text("the driver was interrupted\n")
        raise

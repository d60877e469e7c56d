"""A benchmark run's identity: everything two runs must share for their numbers to be compared.

Profile, dataset (source, size, seed), variants, clients, iterations, world and batch sizes, partitions and
split, the training engine, the broker's kind and version, and a hardware fingerprint. The nightly gate only
compares runs of one identity, and ``kbit compare`` refuses runs of different ones, naming the differences.
Overrides a run was started with are recorded beside the identity: one that changes what is measured keeps the
run from ever becoming a baseline; one that only says where things live (work directory, tracking store,
topic prefix, the local broker's port, the Schema Registry) does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kbit_core.config import KbitConfig, flatten
from kbit_core.errors import StatisticsError

# Overrides under these dotted prefixes move a run elsewhere without changing what it measures.
OPERATIONAL_OVERRIDES = (
    "workdir",
    "tracking.",
    "stack.",
    "produce.topic_prefix",
    "bench.output_dir",
    "kafka.embedded.",
    "registry.",
)
HARDWARE_FINGERPRINT = ("machine", "cpu_model", "cpu_count", "memory_gb", "gpus")


def run_identity(cfg: KbitConfig, hardware: Mapping[str, Any], broker: Mapping[str, str]) -> dict[str, Any]:
    """The identity of a benchmark of ``cfg`` on ``hardware`` (``tracking.hardware``) against ``broker``
    (``{"kind", "version"}``); plain JSON, stable key order."""
    b = cfg.bench
    return {
        "profile": cfg.profile,
        "dataset": {"source": cfg.dataset.name, "num_records": cfg.dataset.num_records, "seed": cfg.dataset.seed},
        "variants": sorted(v.name for v in b.matrix_variants()),
        "clients": sorted(b.clients),
        "decoders": sorted(b.decoders or [cfg.reader.decoder]),
        "iterations": b.iterations,
        "warmup_iterations": b.warmup_iterations,
        "world_sizes": b.world_sizes or [cfg.launch.num_processes],
        "batch_sizes": b.batch_sizes or [cfg.train.global_batch_size],
        "partitions": cfg.produce.partitions,
        "split_rates": list(cfg.shard.split_rates),
        "engine": ("deepspeed" if cfg.deepspeed.enabled else "ddp") if b.train_epoch else "none (loading only)",
        "broker": dict(broker),
        "hardware": {k: hardware.get(k) for k in HARDWARE_FINGERPRINT},
    }


def identity_hash(identity: Mapping[str, Any]) -> str:
    """A short digest of the identity, for finding runs of the same one (an MLflow tag filter)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Every field where identities ``a`` and ``b`` differ, as 'dataset.num_records: 70000 vs 20000'."""
    da, db = flatten(a), flatten(b)
    missing = "(absent)"
    return [
        f"{k}: {da.get(k, missing)} vs {db.get(k, missing)}"
        for k in sorted(da.keys() | db.keys())
        if da.get(k, missing) != db.get(k, missing)
    ]


def measurement_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The overrides (nested or dotted) that change what a run measures, as dotted keys."""
    return {
        k: v
        for k, v in flatten(overrides or {}).items()
        if not any(k == p or k.startswith(p) for p in OPERATIONAL_OVERRIDES)
    }


def stats_identity(stats: Mapping[str, Any], side: str) -> dict[str, Any]:
    """The identity recorded in a stats document; a report without one (older than identities) is refused."""
    identity = stats.get("metadata", {}).get("identity")
    if not isinstance(identity, Mapping):
        raise StatisticsError(f"run {side} records no identity (a report older than run identities)")
    return dict(identity)


def comparability_problems(a_stats: Mapping[str, Any], b_stats: Mapping[str, Any]) -> list[str]:
    """Why runs A and B cannot be compared: a missing identity, or every field their identities differ in."""
    try:
        return identity_differences(stats_identity(a_stats, "A"), stats_identity(b_stats, "B"))
    except StatisticsError as exc:
        return [str(exc)]


def check_comparable(a_stats: Mapping[str, Any], b_stats: Mapping[str, Any]) -> None:
    """Raise :class:`StatisticsError` naming every problem unless runs A and B share one identity."""
    problems = comparability_problems(a_stats, b_stats)
    if problems:
        raise StatisticsError(
            "runs A and B are not comparable: " + "; ".join(problems) + " (pass --force to compare them anyway)"
        )

"""A config as MLflow params: flattened, credentials masked, keys made MLflow-legal."""

from __future__ import annotations

import re
from typing import Any

from kbit_core.config import KbitConfig, flatten
from kbit_core.kafka.settings import mask

MAX_PARAM_CHARS = 6000


def benchmark_settings(cfg: KbitConfig) -> dict[str, Any]:
    """The config sections a benchmark reads: training and DeepSpeed settings only when it times an epoch."""
    data = cfg.to_dict()
    sections = ["profile", "workdir", "dataset", "kafka", "shard", "reader", "launch", "bench"]
    if cfg.bench.train_epoch:
        sections += ["train", "deepspeed"]
    out = {k: data[k] for k in sections}
    # The produce section's single variant is the training run's; a benchmark produces bench.variants.
    out["produce"] = {k: v for k, v in data["produce"].items() if k != "variant"}
    if not cfg.bench.batch_sizes:
        out["train"] = {**out.get("train", {}), "global_batch_size": cfg.train.global_batch_size}
    return out


def config_params(cfg: KbitConfig, kind: str = "train") -> dict[str, str]:
    """The config as MLflow params (a benchmark's own settings for ``kind='benchmark'``): flattened, credentials
    masked, keys made MLflow-legal."""
    params = mask(flatten(benchmark_settings(cfg) if kind == "benchmark" else cfg.to_dict()))
    return {re.sub(r"[^\w\-. /]", "_", k)[:250]: str(v)[:MAX_PARAM_CHARS] for k, v in params.items()}

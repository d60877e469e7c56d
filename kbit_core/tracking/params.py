"""A config as MLflow params: only the settings the run used, flattened, rounded for reading, credentials masked,
keys made MLflow-legal. The exact config goes beside them as the run's ``config.json`` artifact."""

from __future__ import annotations

import math
import re
from typing import Any

from kbit_core.config import KbitConfig, flatten
from kbit_core.kafka.settings import mask

MAX_PARAM_CHARS = 6000
# Significant digits of a float where people read it (params, tags, descriptions); metrics stay exact.
READABLE_DIGITS = 4
# Sections a training run reads; the benchmark's own are listed in benchmark_settings.
TRAINING_SECTIONS = ("profile", "workdir", "dataset", "kafka", "produce", "shard", "reader", "train", "stream")
TRAINING_SECTIONS += ("deepspeed", "checkpoint", "launch")
SPARK_ONLY = ("launch.master", "launch.local_mode", "launch.executor_", "launch.driver_", "launch.block_manager_port")
SPARK_ONLY += ("launch.spark_conf",)
GPU_ONLY = ("launch.executor_gpu_amount", "launch.task_gpu_amount", "launch.gpu_discovery_script")


def readable(value: Any) -> Any:
    """``value`` with every float (in lists and dicts too) rounded to READABLE_DIGITS significant digits."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{READABLE_DIGITS}g}")
    if isinstance(value, dict):
        return {k: readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value


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


def unused_prefixes(cfg: KbitConfig, kind: str) -> tuple[str, ...]:
    """Dotted-key prefixes of settings this run never read: another launcher's, the GPU's when on CPU, another
    transport's credentials and files, the embedded broker's with an external one, DeepSpeed's when it is off,
    the live stream's in batch training."""
    engines = {cfg.launch.engine, *((cfg.bench.engines or []) if kind == "benchmark" else [])}
    protocol = cfg.kafka.security_protocol
    unused: list[str] = []
    unused += ["launch.ray_"] if "ray" not in engines else []
    unused += list(SPARK_ONLY + GPU_ONLY) if "spark" not in engines else []
    unused += list(GPU_ONLY) if not cfg.launch.use_gpu else []
    unused += ["kafka.sasl_"] if not protocol.startswith("SASL") else []
    unused += ["kafka.ssl_"] if "SSL" not in protocol else []
    unused += ["kafka.embedded."] if not cfg.kafka.uses_embedded else ["kafka.bootstrap_servers"]
    unused += (
        [f"deepspeed.{k}" for k in type(cfg.deepspeed).model_fields if k != "enabled"]
        if not cfg.deepspeed.enabled
        else []
    )
    unused += ["stream."] if cfg.train.mode != "continuous" else []
    return tuple(unused)


def run_settings(cfg: KbitConfig, kind: str, *, rounded: bool = False) -> dict[str, Any]:
    """The settings the run read (a benchmark's own for ``kind='benchmark'``), flattened and masked; exact values
    unless ``rounded`` (see :func:`readable`)."""
    data = benchmark_settings(cfg) if kind == "benchmark" else {k: cfg.to_dict()[k] for k in TRAINING_SECTIONS}
    unused = unused_prefixes(cfg, kind)
    return {k: v for k, v in mask(flatten(readable(data) if rounded else data)).items() if not k.startswith(unused)}


def config_params(cfg: KbitConfig, kind: str = "train") -> dict[str, str]:
    """:func:`run_settings` as MLflow params, rounded for reading, keys made MLflow-legal."""
    params = run_settings(cfg, kind, rounded=True)
    return {re.sub(r"[^\w\-. /]", "_", k)[:250]: str(v)[:MAX_PARAM_CHARS] for k, v in params.items()}

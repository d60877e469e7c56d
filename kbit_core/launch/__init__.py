"""Launching distributed work: one dispatch point, :func:`launch`, over Spark's TorchDistributor, Ray Train and
plain torchrun."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.launch.distributor import run_distributed
from kbit_core.launch.ray_train import run_ray
from kbit_core.launch.torchrun import run_torchrun


def launch(entry: Any, cfg: KbitConfig, *args: Any, result_type: Any = None) -> Any:
    """Run ``entry(cfg, *args)`` on every rank with the engine ``launch.engine`` names; rank 0's result, typed.

    All engines share one contract (see :func:`kbit_core.launch.distributor.run_distributed`): the config
    crosses once as JSON, arguments and the result as hand-off JSON, and a failure raises a
    ``WorkerFailedError`` (``RankDiedError`` when a rank's process died).
    """
    if cfg.launch.engine == "ray":
        return run_ray(entry, cfg, *args, result_type=result_type)
    if cfg.launch.engine == "torchrun":
        return run_torchrun(entry, cfg, *args, result_type=result_type)
    return run_distributed(entry, cfg, *args, result_type=result_type)

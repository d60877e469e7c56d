"""The user's own pieces, named by import path ('package.module:attribute'): model factory, loss, metrics,
optimizer class and LR scheduler factory.

Every one resolves through :func:`kbit_core.user_imports.import_object`, so a misspelled path fails the same way
wherever it is named: one line with the setting, the path and what is wrong. The driver's preflight resolves them all before anything is
produced or launched (``kbit_core.jobs.preflight``); the ranks resolve them again when they build the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kbit_core.config import TrainConfig
from kbit_core.user_imports import import_object, is_import_path

# (logits float32[B, classes], targets int64[B]) -> mean loss over the batch (a scalar tensor).
LossFn = Callable[[Tensor, Tensor], Tensor]
# (logits, targets) -> one value per sample, float[B]; kbit sums them and the sample count over ranks, reports the mean.
MetricFn = Callable[[Tensor, Tensor], Tensor]

BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": F.cross_entropy}


def resolve_loss(train: TrainConfig) -> LossFn:
    """``train.loss``: 'cross_entropy' or the user's ``fn(logits, targets) -> mean loss``."""
    return import_object(train.loss, "train.loss", BUILTIN_LOSSES)


def resolve_metrics(train: TrainConfig) -> dict[str, MetricFn]:
    """``train.metrics``: result name -> the user's ``fn(logits, targets) -> per-sample values``."""
    return {name: import_object(spec, f"train.metrics.{name}") for name, spec in train.metrics.items()}


def resolve_optimizer_class(train: TrainConfig) -> type[torch.optim.Optimizer] | None:
    """The user's optimizer class when ``train.optim.name`` is an import path; None for the built-in names."""
    name = train.optim.name
    return import_object(name, "train.optim.name") if is_import_path(name) else None


def resolve_scheduler_factory(train: TrainConfig) -> Callable[..., Any] | None:
    """The user's scheduler factory when ``train.optim.schedule`` is an import path; None for the built-in ones."""
    schedule = train.optim.schedule
    return import_object(schedule, "train.optim.schedule") if is_import_path(schedule) else None


def resolve_all(train: TrainConfig) -> None:
    """Import every user piece the train section names (the model is built separately, for its shape check)."""
    resolve_loss(train)
    resolve_metrics(train)
    resolve_optimizer_class(train)
    resolve_scheduler_factory(train)

"""Optimizer, learning-rate schedule (stepped once per optimizer step) and the linear LR scaling rule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from kbit_core.config import OptimConfig
from kbit_core.errors import ConfigError
from kbit_core.train.user_code import import_object, is_import_path

# One-cycle shape, as torch's OneCycleLR defaults: start at lr/25, peak at 30 % of the run, end at lr/25e4.
ONECYCLE_DIV = 25.0
ONECYCLE_FINAL_DIV = 1e4
ONECYCLE_PEAK = 0.3


def effective_lr(optim: OptimConfig, world_size: int, grad_accum_steps: int) -> float:
    """The base LR, multiplied by world_size × grad_accum_steps under the linear scaling rule."""
    return optim.lr * world_size * grad_accum_steps if optim.scale_lr_linearly else optim.lr


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """A plain torch optimizer (DeepSpeed accepts it too, so nothing JIT-compiles on CPU), or the user's class named
    by ``optim.name`` = 'package.module:Class', given lr, weight_decay and ``optim.kwargs``."""
    if is_import_path(optim.name):
        user_class = import_object(optim.name, "train.optim.name")
        try:
            return user_class(params, lr=lr, weight_decay=optim.weight_decay, **optim.kwargs)
        except TypeError as exc:
            raise ConfigError(f"train.optim: cannot build {optim.name!r} with kwargs {optim.kwargs}: {exc}") from None
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    cls = torch.optim.AdamW if optim.name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=optim.weight_decay)


def lr_multiplier(optim: OptimConfig, step: int, steps_per_epoch: int, total_steps: int) -> float:
    """Factor applied to the base LR before optimizer step ``step`` (0-based): linear warm-up × schedule.

    Args:
        optim: The optimizer section (schedule, warmup_steps, step_size_epochs, gamma).
        step: Optimizer steps already taken.
        steps_per_epoch: Optimizer steps in one epoch (for the 'step' schedule).
        total_steps: Optimizer steps in the whole run (for 'cosine' and 'onecycle').
    """
    if optim.schedule == "onecycle":
        peak = max(1, optim.warmup_steps or round(ONECYCLE_PEAK * total_steps))
        if step < peak:
            return _cosine_between(1 / ONECYCLE_DIV, 1.0, step / peak)
        return _cosine_between(1.0, 1 / (ONECYCLE_DIV * ONECYCLE_FINAL_DIV), (step - peak) / max(1, total_steps - peak))
    warmup = min(1.0, (step + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0
    if optim.schedule == "cosine":
        progress = max(0, step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        return warmup * _cosine_between(1.0, 0.0, progress)
    if optim.schedule == "step":
        return warmup * optim.gamma ** (step // (optim.step_size_epochs * max(1, steps_per_epoch)))
    return warmup


def _cosine_between(start: float, end: float, progress: float) -> float:
    progress = min(1.0, max(0.0, progress))
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, steps_per_epoch: int, total_steps: int
) -> LRScheduler:
    """A LambdaLR over :func:`lr_multiplier`; its state_dict holds only counters, so it loads with weights_only.

    ``optim.schedule`` = 'package.module:factory' calls the user's
    ``factory(optimizer, steps_per_epoch=..., total_steps=..., **optim.schedule_kwargs)`` instead; what it returns is
    stepped once per optimizer step and saved in checkpoints by its ``state_dict``.
    """
    if is_import_path(optim.schedule):
        factory = import_object(optim.schedule, "train.optim.schedule")
        try:
            scheduler = factory(
                optimizer, steps_per_epoch=steps_per_epoch, total_steps=total_steps, **optim.schedule_kwargs
            )
        except TypeError as exc:
            raise ConfigError(f"train.optim.schedule={optim.schedule!r}: cannot call it: {exc}") from None
        if not isinstance(scheduler, LRScheduler):
            raise ConfigError(
                f"train.optim.schedule={optim.schedule!r} returned {type(scheduler).__name__}, not an LRScheduler"
            )
        return scheduler

    def multiplier(step: int) -> float:
        return lr_multiplier(optim, step, steps_per_epoch, total_steps)

    return LambdaLR(optimizer, multiplier)

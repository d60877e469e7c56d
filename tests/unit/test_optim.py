"""Optimizer choice, the linear scaling rule and LR schedule shapes."""

from __future__ import annotations

import math

import pytest
import torch

from kbit_core.config import OptimConfig
from kbit_core.errors import ConfigError
from kbit_core.train.optim import build_optimizer, build_scheduler, effective_lr, lr_multiplier


def test_linear_scaling_rule_multiplies_by_world_size_and_accumulation() -> None:
    assert effective_lr(OptimConfig(lr=0.01, scale_lr_linearly=True), world_size=4, grad_accum_steps=2) == 0.08
    assert effective_lr(OptimConfig(lr=0.01), world_size=4, grad_accum_steps=2) == 0.01


@pytest.mark.parametrize(
    "name, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)]
)
def test_optimizer_by_name(name: str, cls: type) -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimConfig(name=name, weight_decay=0.1), lr=0.5)
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.1


def test_warmup_is_linear_then_constant() -> None:
    cfg = OptimConfig(warmup_steps=4)
    assert [lr_multiplier(cfg, s, 10, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_zero_after_warmup() -> None:
    cfg = OptimConfig(schedule="cosine", warmup_steps=2)
    values = [lr_multiplier(cfg, s, 10, 12) for s in range(13)]
    assert values[:2] == [0.5, 1.0] and values[2] == 1.0
    assert values[7] == pytest.approx(0.5) and values[12] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))


def test_step_schedule_decays_every_step_size_epochs() -> None:
    cfg = OptimConfig(schedule="step", step_size_epochs=2, gamma=0.5)
    assert [lr_multiplier(cfg, s, 3, 30) for s in (0, 5, 6, 11, 12)] == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_onecycle_rises_to_peak_then_anneals() -> None:
    cfg = OptimConfig(schedule="onecycle")
    values = [lr_multiplier(cfg, s, 10, 100) for s in range(101)]
    assert values[0] == pytest.approx(1 / 25) and max(values) == values[30] == 1.0
    assert values[100] == pytest.approx(1 / 25e4)


def test_scheduler_steps_the_optimizer_lr_and_round_trips_its_state() -> None:
    cfg = OptimConfig(lr=1.0, schedule="cosine")
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg, lr=1.0)
    sched = build_scheduler(opt, cfg, steps_per_epoch=5, total_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    fresh_opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg, lr=1.0)
    fresh = build_scheduler(fresh_opt, cfg, steps_per_epoch=5, total_steps=10)
    fresh.load_state_dict(sched.state_dict())
    fresh_opt.step()
    fresh.step()
    opt.step()
    sched.step()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_users_optimizer_class_and_scheduler_factory_by_import_path() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    optim = OptimConfig(
        name="torch.optim:RMSprop",
        kwargs={"alpha": 0.8},
        weight_decay=0.1,
        schedule="tests.integration.user_pieces:halve_every_steps",
        schedule_kwargs={"every": 2},
    )
    opt = build_optimizer(params, optim, lr=0.4)
    assert type(opt) is torch.optim.RMSprop and opt.param_groups[0]["alpha"] == 0.8
    assert opt.param_groups[0]["weight_decay"] == 0.1
    scheduler = build_scheduler(opt, optim, steps_per_epoch=3, total_steps=9)
    lrs = []
    for _ in range(5):
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.4, 0.2, 0.2, 0.1, 0.1])


@pytest.mark.parametrize(
    "optim, message",
    [
        (OptimConfig(name="torch.optim:SGD", kwargs={"alpha": 1}), r"^train.optim: cannot build 'torch.optim:SGD'"),
        (
            OptimConfig(schedule="torch.optim.lr_scheduler:StepLR"),
            r"^train.optim.schedule='torch.optim.lr_scheduler:StepLR': cannot call it",
        ),
        (OptimConfig(schedule="math:floor"), r"^train.optim.schedule='math:floor': cannot call it"),
        (
            OptimConfig(schedule="tests.integration.user_pieces:top2"),
            r"^train.optim.schedule='tests.integration.user_pieces:top2': cannot call it",
        ),
    ],
)
def test_user_optimizer_or_schedule_that_does_not_fit_is_named(optim: OptimConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim, lr=0.1)
        build_scheduler(opt, optim, steps_per_epoch=1, total_steps=1)


def test_optimizer_and_schedule_names_are_built_in_or_import_paths() -> None:
    with pytest.raises(ValueError, match="optim.name='rmsprop' is neither adam | adamw | sgd nor"):
        OptimConfig(name="rmsprop")
    with pytest.raises(ValueError, match="optim.schedule='linear' is neither constant"):
        OptimConfig(schedule="linear")
    with pytest.raises(ValueError, match="optim.kwargs is for an optimizer named by import path"):
        OptimConfig(kwargs={"betas": [0.9, 0.99]})

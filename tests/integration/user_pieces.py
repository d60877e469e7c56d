"""A user's own loss, metrics and LR schedule, named by import path in the tests' configs (the ranks import them
as a user's package would be imported)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LRScheduler, StepLR

# Label smoothing keeps the loss above the smoothed target's entropy, so a result shows which loss was trained.
SMOOTHING = 0.1


def smoothed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, label_smoothing=SMOOTHING)


def top2(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """1.0 where the target is among the two highest logits."""
    return (logits.topk(2, dim=1).indices == targets[:, None]).any(dim=1).float()


def error(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=1) != targets).float()


def halve_every_steps(
    optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int, every: int = 4
) -> LRScheduler:
    return StepLR(optimizer, step_size=every, gamma=0.5)

"""Exponential moving average of the weights (and buffers), evaluated instead of the raw model when enabled."""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """A copy of ``model`` updated as ema = decay·ema + (1−decay)·weights by ``update_parameters(model)``.

    Buffers (batch-norm statistics) are averaged too, so the EMA model can be evaluated as is.
    """
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

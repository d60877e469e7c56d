"""Mixed precision for the DDP engine: bf16 autocast on CPU; bf16 or fp16 (with a GradScaler) on GPU."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from kbit_core.errors import ConfigError

PrecisionName = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How forward passes run; parameters and optimizer state stay float32."""

    name: PrecisionName
    device: torch.device

    def __post_init__(self) -> None:
        if self.name == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.precision=fp16 needs a GPU (CPU autocast supports bf16)")

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 has float32's range and needs none."""
        return torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None

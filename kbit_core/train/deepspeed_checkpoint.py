"""DeepSpeed's checkpoint files read with ``torch.load(weights_only=True)`` instead of DeepSpeed's full unpickling.

Call only after ``distributed.import_deepspeed`` (it picks DeepSpeed's accelerator before the first import): the
module imports DeepSpeed inside its functions, so batch training without DeepSpeed never loads it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kbit_core.errors import ConfigError


@functools.cache
def safe_globals() -> tuple[type, ...]:
    """Besides tensors and builtins, ZeRO's optimizer-state files pickle these (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-1/2/3 checkpoints; DynamicLossScaler is fp16's).
    Each is plain data restored by setting attributes, with no __setstate__ or __reduce__ of its own, so allowing
    them runs no code from the file."""
    # DeepSpeed imported here, as in every function of this module: only DeepSpeed runs load it.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


@functools.cache
def weights_only_engine_type() -> type:
    """DeepSpeed's default torch.save/torch.load engine, loading with weights_only=True (a class made on first use,
    since its base class comes from DeepSpeed)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            with torch.serialization.safe_globals(list(safe_globals())):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine


def use_weights_only_loading(engine: Any) -> None:
    """Make the DeepSpeed ``engine`` read its checkpoints with :func:`weights_only_engine_type`'s engine.

    Raises:
        ConfigError: ``deepspeed.raw`` chose another checkpoint engine (writer or datastates), whose loading
            kbit cannot restrict the same way.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise ConfigError(
            f"DeepSpeed chose the checkpoint engine {type(current).__name__}; kbit supports only the "
            "default one (remove checkpoint.writer / datastates from deepspeed.raw)"
        )
    # _config is the DeepSpeedConfig that DeepSpeed itself builds its checkpoint engine from.
    engine.checkpoint_engine = weights_only_engine_type()(engine._config)


@contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every torch.load inside reads weights only, even where DeepSpeed asks for full unpickling (zero_to_fp32)."""
    # torch reads this variable at each load, and it overrides an explicit weights_only=False.
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(list(safe_globals())):
            yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def consolidated_fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from a ZeRO checkpoint directory (DeepSpeed's zero_to_fp32: the fp32 master
    copies gathered from every rank's optimizer partitions, not the bf16/fp16 working copy)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with _weights_only_loads():
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {name: tensor.contiguous() for name, tensor in state.items()}

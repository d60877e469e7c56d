"""DeepSpeed's checkpoint files read with ``torch.load(weights_only=True)`` instead of DeepSpeed's full unpickling.

Call only after ``distributed.import_deepspeed`` (it picks DeepSpeed's accelerator before the first import): the
module imports DeepSpeed inside its functions, so batch training without DeepSpeed never loads it.
"""

from __future__ import annotations

import argparse
import functools
import io
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from kbit_core.errors import ConfigError

log = logging.getLogger(__name__)

# Inside a ZeRO checkpoint directory: its universal form, which a ZeRO engine of any data-parallel size loads.
UNIVERSAL_TAG = "universal"


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


@contextmanager
def allowed_safe_globals() -> Iterator[None]:
    """:func:`safe_globals` allowed for weights-only loads inside. Unlike torch's own context it nests: torch's
    removes its globals on exit even where an enclosing one had allowed them (a universal load nests the checkpoint
    engine's loads inside :func:`weights_only_loads`), so this one adds and removes only those not yet allowed."""
    allowed = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([cls for cls in safe_globals() if cls not in allowed]):
        yield


@functools.cache
def weights_only_engine_type() -> type:
    """DeepSpeed's default torch.save/torch.load engine, loading with weights_only=True (a class made on first use,
    since its base class comes from DeepSpeed)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            with allowed_safe_globals():
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
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside reads weights only, even where DeepSpeed asks for full unpickling (zero_to_fp32)."""
    # torch reads this variable at each load, and it overrides an explicit weights_only=False.
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with allowed_safe_globals():
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

    with weights_only_loads():
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {name: tensor.contiguous() for name, tensor in state.items()}


def convert_to_universal(checkpoint: Path) -> Path:
    """The universal form of the ZeRO checkpoint directory ``checkpoint``, made by DeepSpeed's ds_to_universal on
    first use: each parameter whole, with its fp32 master copy, Adam moments and step (``universal/zero/<name>/``),
    so that a ZeRO engine of any data-parallel size partitions them anew. Call on one rank.

    It is written into a hidden temp directory beside it and renamed into place, so a visible ``universal/`` is
    complete and a later resume at yet another world size reuses it.
    """
    from deepspeed.checkpoint import ds_to_universal

    target = checkpoint / UNIVERSAL_TAG
    if target.is_dir():
        log.warning("elastic resume: reusing the universal checkpoint %s", target)
        return target
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(dir=checkpoint, prefix=f".{UNIVERSAL_TAG}.", suffix=".tmp"))
    args = argparse.Namespace(
        input_folder=str(checkpoint),
        output_folder=str(staging),
        # Worker processes of its own would be children of a rank (daemonic under some launchers): convert inline.
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # kbit's models carry no universal-checkpoint info of their own (no tensor or pipeline parallel slicing
        # patterns); DeepSpeed's default says every parameter is whole.
        inject_missing_state=True,
    )
    chatter = io.StringIO()  # its argument dump, progress bars and stage headings
    try:
        with weights_only_loads(), redirect_stdout(chatter), redirect_stderr(chatter):
            ds_to_universal.main(args)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        # It names its output, the staging directory, in a 'latest_universal' file beside it; kbit loads by tag.
        (checkpoint / "latest_universal").unlink(missing_ok=True)
    log.debug("ds_to_universal output:\n%s", chatter.getvalue())
    log.warning(
        "elastic resume: converted %s to the universal checkpoint %s in %.2f s",
        checkpoint,
        target,
        time.perf_counter() - start,
    )
    return target


def load_universal(engine: Any, universal: Path) -> dict[str, Any]:
    """Load the universal checkpoint directory ``universal`` into the DeepSpeed ``engine`` (model, fp32 master
    weights, optimizer moments, re-partitioned for this run's ranks); return its client state."""
    # DeepSpeed reads `checkpoint.load_universal` from its config at each load_checkpoint call, not at
    # initialize; kbit decides per resume (only a world-size change needs it), so it sets it for this load.
    engine._config.load_universal_checkpoint = True
    try:
        # The optimizer reads zero/<param>/*.pt with a plain torch.load, past the checkpoint engine.
        with weights_only_loads():
            loaded, client_state = engine.load_checkpoint(
                str(universal.parent), tag=universal.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded is None:
        raise ConfigError(f"DeepSpeed could not load the universal checkpoint {universal}")
    return client_state

"""Generate the DeepSpeed JSON config from kbit's typed config (``deepspeed.raw`` is merged over it)."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.data.schedule import per_rank_batch_size

# DeepSpeed prints a throughput line every steps_per_print steps; kbit reports its own metrics.
QUIET_STEPS_PER_PRINT = 2**31 - 1


def engine_name(cfg: KbitConfig) -> str:
    """'deepspeed-zeroN', the name results and tracking use for this engine."""
    return f"deepspeed-zero{cfg.deepspeed.zero_stage}"


def build_deepspeed_config(cfg: KbitConfig, world_size: int, use_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config dict for this run.

    The client passes a plain torch optimizer and steps the LR schedule itself, so the config has no
    ``optimizer`` or ``scheduler`` section and nothing is JIT-compiled on CPU. Keys in
    ``cfg.deepspeed.raw`` are merged over the generated ones (raw wins, nested sections merge).

    Args:
        cfg: The run's configuration (train and deepspeed sections).
        world_size: Number of ranks (pipeline stages × data-parallel ranks).
        use_gpu: Whether ranks run on CUDA (pinned host memory for offload only helps then).
    """
    ds, train = cfg.deepspeed, cfg.train
    # A pipeline's stages share each data-parallel rank's batch, which it splits into micro-batches.
    data_parallel = world_size // train.pipeline.stages
    micro_batches = train.pipeline.micro_batches
    micro = per_rank_batch_size(train.global_batch_size, data_parallel) // micro_batches
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": use_gpu}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train.grad_accum_steps * micro_batches,
        "train_batch_size": micro * train.grad_accum_steps * micro_batches * data_parallel,
        "gradient_clipping": train.grad_clip_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        # loss_scale 0 selects dynamic loss scaling: overflowing steps are skipped and the scale lowered.
        "fp16": {
            "enabled": train.precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # The client optimizer is a torch one; ZeRO accepts it only with these two switches.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": QUIET_STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if ds.activation_checkpointing:
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": ds.offload_param,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
        }
    return deep_merge(config, ds.raw) if ds.raw else config

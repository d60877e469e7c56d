"""kbit config → DeepSpeed JSON: every ZeRO stage, offload, precision, accumulation, clipping and raw overrides."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from kbit_core.config import KbitConfig
from kbit_core.train.deepspeed_config import build_deepspeed_config, engine_name
from kbit_core.train.distributed import import_deepspeed


def make(**sections: Any) -> KbitConfig:
    return KbitConfig.from_dict({"launch": {"num_processes": 2}, **sections})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage(stage: int) -> None:
    cfg = make(deepspeed={"enabled": True, "zero_stage": stage})
    ds = build_deepspeed_config(cfg, world_size=2, use_gpu=False)
    assert ds["zero_optimization"] == {"stage": stage}
    assert engine_name(cfg) == f"deepspeed-zero{stage}"
    assert "optimizer" not in ds and "scheduler" not in ds  # the client's torch optimizer: nothing JIT-compiles
    assert ds["zero_allow_untested_optimizer"] is True


def test_batch_sizes_accumulation_and_clipping() -> None:
    cfg = make(train={"global_batch_size": 64, "grad_accum_steps": 4, "grad_clip_norm": 1.5})
    ds = build_deepspeed_config(cfg, world_size=2, use_gpu=False)
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 32 * 4 * 2 and ds["gradient_clipping"] == 1.5
    assert build_deepspeed_config(make(), 2, False)["gradient_clipping"] == 0.0


def test_micro_batch_is_the_loaders_per_rank_batch() -> None:
    ds = build_deepspeed_config(make(train={"global_batch_size": 33}), world_size=2, use_gpu=False)
    assert ds["train_micro_batch_size_per_gpu"] == 16 and ds["train_batch_size"] == 32


@pytest.mark.parametrize("stage, offload_param", [(2, False), (3, False), (3, True)])
def test_offload_to_cpu(stage: int, offload_param: bool) -> None:
    cfg = make(
        deepspeed={"enabled": True, "zero_stage": stage, "offload_optimizer": True, "offload_param": offload_param}
    )
    zero = build_deepspeed_config(cfg, 2, use_gpu=True)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ("offload_param" in zero) is offload_param
    on_cpu = build_deepspeed_config(cfg, 2, use_gpu=False)["zero_optimization"]
    assert on_cpu["offload_optimizer"]["pin_memory"] is False


@pytest.mark.parametrize(
    "precision, use_gpu, bf16, fp16",
    [("fp32", False, False, False), ("bf16", False, True, False), ("fp16", True, False, True)],
)
def test_precision_sections(precision: str, use_gpu: bool, bf16: bool, fp16: bool) -> None:
    cfg = make(train={"precision": precision}, launch={"num_processes": 2, "use_gpu": use_gpu})
    ds = build_deepspeed_config(cfg, 2, use_gpu)
    assert ds["bf16"]["enabled"] is bf16 and ds["fp16"]["enabled"] is fp16
    assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_activation_checkpointing_section_only_when_enabled() -> None:
    assert "activation_checkpointing" not in build_deepspeed_config(make(), 2, False)
    cfg = make(deepspeed={"enabled": True, "zero_stage": 3, "activation_checkpointing": True, "offload_param": True})
    section = build_deepspeed_config(cfg, 2, False)["activation_checkpointing"]
    assert section["cpu_checkpointing"] is True and section["partition_activations"] is False


def test_raw_overrides_merge_over_generated() -> None:
    raw = {"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 2.0, "steps_per_print": 10}
    ds = build_deepspeed_config(make(deepspeed={"enabled": True, "zero_stage": 2, "raw": raw}), 2, False)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["gradient_clipping"] == 2.0 and ds["steps_per_print"] == 10
    assert ds["train_micro_batch_size_per_gpu"] == 32  # untouched keys stay generated


def test_unimportable_deepspeed_falls_back_to_ddp_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what Python does for a module that failed to import
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored afterwards: import_deepspeed sets it for CPU ranks
    with pytest.warns(RuntimeWarning, match="deepspeed cannot be imported .* falling back to DDP"):
        assert import_deepspeed(torch.device("cpu")) is None


def test_norm_statistics_follow_parameters_that_deepspeed_cast_to_half():
    """DeepSpeed fp16 halves parameters only; CUDA batch norm then refuses float running statistics."""
    import torch
    from torch import nn

    from kbit_core.train.engine import _match_buffers_to_parameters

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    for parameter in model.parameters():
        parameter.data = parameter.data.half()
    _match_buffers_to_parameters(model)
    norm = model[1]
    assert norm.running_mean.dtype == norm.running_var.dtype == torch.float16
    assert norm.num_batches_tracked.dtype == torch.int64  # counters stay integers
    assert dict(model.named_buffers()).keys() == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}

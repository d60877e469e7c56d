"""How ranks train: model, optimizer, parallelism, training, streaming, DeepSpeed and checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from kbit_core.config.base import Section
from kbit_core.config.data import DatasetConfig, ProduceConfig


class ModelConfig(Section):
    name: str = Field("cnn", description="mlp | cnn | resnet | vit | token_transformer | 'package.module:factory'.")
    kwargs: dict[str, Any] = Field(default_factory=dict)


BUILTIN_OPTIMIZERS = ("adam", "adamw", "sgd")


BUILTIN_SCHEDULES = ("constant", "cosine", "step", "onecycle")


class OptimConfig(Section):
    name: str = Field(
        "adam",
        description="adam | adamw | sgd | 'package.module:Class' (a torch.optim.Optimizer class, given the "
        "parameters, lr and weight_decay, plus optim.kwargs).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="More arguments for a user optimizer class.")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.9, ge=0)
    scale_lr_linearly: bool = Field(False, description="lr × world_size × accum (the linear scaling rule).")
    schedule: str = Field(
        "constant",
        description="constant | cosine | step | onecycle | 'package.module:factory' (called with the optimizer, "
        "steps_per_epoch, total_steps and optim.schedule_kwargs; returns a scheduler stepped once per optimizer step).",
    )
    schedule_kwargs: dict[str, Any] = Field(default_factory=dict, description="More arguments for a user scheduler.")
    warmup_steps: int = Field(0, ge=0)
    step_size_epochs: int = Field(1, ge=1)
    gamma: float = Field(0.5, gt=0)

    @model_validator(mode="after")
    def _check_names(self) -> OptimConfig:
        # Import paths are resolved (and a misspelling named) by the preflight and the ranks, not here: the
        # config is validated where the user's packages may not be importable (the CLI's --set parsing).
        for setting, value, builtin in (
            ("name", self.name, BUILTIN_OPTIMIZERS),
            ("schedule", self.schedule, BUILTIN_SCHEDULES),
        ):
            if value not in builtin and ":" not in value:
                raise ValueError(
                    f"optim.{setting}={value!r} is neither {' | '.join(builtin)} nor 'package.module:attribute'"
                )
        if self.kwargs and self.name in BUILTIN_OPTIMIZERS:
            raise ValueError("optim.kwargs is for an optimizer named by import path, not the built-in " + self.name)
        return self


class PipelineConfig(Section):
    stages: int = Field(
        1, ge=1, description="Pipeline stages (DeepSpeed PipelineModule); ranks = stages × data-parallel ranks."
    )
    micro_batches: int = Field(1, ge=1, description="Micro-batches each data-parallel rank's batch is split into.")
    partition: Literal["parameters", "uniform"] = Field(
        "parameters", description="How layers are cut into stages: balanced by parameter count, or by layer count."
    )


class TensorParallelConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks (torch DTensor): each transformer block's attention and MLP split by "
        "heads and hidden units across them; ranks = size × data-parallel ranks.",
    )


class TrainConfig(Section):
    mode: Literal["batch", "continuous"] = Field(
        "batch",
        description="batch: epochs over a produced topic; continuous: train on a live stream as it "
        "arrives (the `stream` section).",
    )
    data: Literal["kafka", "memory", "direct"] = Field(
        "kafka",
        description="kafka: stream shards from the produced topic; memory: read each shard from Kafka first; direct: "
        "no Kafka, each rank reads its shard straight from the dataset (any dataset source, see docs/training.md).",
    )
    epochs: int = Field(2, ge=1)
    global_batch_size: int = Field(64, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    grad_clip_norm: float | None = Field(None, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    ema_decay: float | None = Field(None, gt=0, lt=1)
    sync_batchnorm: bool = True
    nan_policy: Literal["fail", "skip"] = "fail"
    loss_spike_factor: float = Field(10.0, gt=1)
    max_steps_per_epoch: int | None = Field(None, ge=1)
    stand_in_step_ms: float | None = Field(
        None,
        ge=0,
        description="Benchmarks only (`kbit bench-train --fast-consumer`): no model is trained; each step is a busy "
        "wait of this many ms holding the interpreter lock (0: none), standing in for a fast GPU step so the "
        "loader's own ceiling shows.",
    )
    seed: int = 0
    deterministic: bool = True
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    loss: str = Field(
        "cross_entropy",
        description="cross_entropy | 'package.module:fn', fn(logits, targets) -> the batch's mean loss.",
    )
    metrics: dict[str, str] = Field(
        default_factory=dict,
        description="name -> 'package.module:fn', fn(logits, targets) -> one value per sample; the mean over all "
        "ranks' validation and test samples is reported as val_<name> and test_<name>.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each top-level block's activations in backward (DDP: torch.utils.checkpoint)."
    )
    pipeline: PipelineConfig = PipelineConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()

    @model_validator(mode="after")
    def _check_direct(self) -> TrainConfig:
        if self.mode == "continuous" and self.data == "direct":
            raise ValueError(
                "train.data=direct reads a dataset in epochs; train.mode=continuous trains on a live topic"
            )
        return self

    @model_validator(mode="after")
    def _check_model_parallel(self) -> TrainConfig:
        if self.tensor_parallel.size > 1:
            _refuse_conflicts(
                f"train.tensor_parallel.size={self.tensor_parallel.size}",
                ("train.pipeline.stages > 1", self.pipeline.stages > 1),
                ("train.ema_decay", self.ema_decay is not None),
                ("train.grad_clip_norm (the norm of sharded and whole parameters together)", bool(self.grad_clip_norm)),
                ("train.precision=fp16", self.precision == "fp16"),
                ("train.mode=continuous", self.mode == "continuous"),
            )
        if self.pipeline.stages > 1:
            _refuse_conflicts(
                f"train.pipeline.stages={self.pipeline.stages}",
                ("train.grad_accum_steps > 1 (use train.pipeline.micro_batches)", self.grad_accum_steps > 1),
                ("train.ema_decay", self.ema_decay is not None),
                ("train.nan_policy=skip (a pipeline steps inside one call)", self.nan_policy == "skip"),
                ("train.mode=continuous", self.mode == "continuous"),
            )
        return self


def _refuse_conflicts(feature: str, *settings: tuple[str, bool]) -> None:
    """ValueError naming every setting in ``settings`` that is on and does not work with ``feature``."""
    conflicts = [setting for setting, on in settings if on]
    if conflicts:
        raise ValueError(f"{feature} does not work with {', '.join(conflicts)}")


class StreamConfig(Section):
    """A live stream: what `kbit produce --stream` appends and what `train.mode: continuous` trains on."""

    topic: str | None = Field(None, description="Stream topic; derived from dataset and variant when unset.")
    rate: float = Field(1000.0, gt=0, description="Producer: records per second to append.")
    duration_s: float | None = Field(None, gt=0, description="Producer: stop after this long (unset: no limit).")
    records: int | None = Field(
        None,
        ge=1,
        description="Producer: stop after this many records in the stream (counting what earlier runs appended).",
    )
    start: Literal["checkpoint", "earliest", "offsets", "timestamp"] = Field(
        "checkpoint",
        description="Where a fresh run starts: a checkpoint's offsets (else the beginning), the "
        "beginning, start_offsets, or the first record produced at/after start_timestamp_ms.",
    )
    start_offsets: dict[int, int] = Field(
        default_factory=dict, description="start=offsets: partition -> offset (unlisted partitions: the beginning)."
    )
    start_timestamp_ms: int | None = Field(None, ge=0, description="start=timestamp: produce time in ms since epoch.")
    stop_after_s: float | None = Field(None, gt=0, description="Trainer: stop after this long.")
    stop_after_records: int | None = Field(
        None, ge=1, description="Trainer: stop once this many records are trained (in total, across restarts)."
    )
    stop_file: Path | None = Field(
        None,
        description="Trainer: stop cleanly once this file exists (relative: to the "
        "workdir); unset = <workdir>/streams/<topic>.stop.",
    )
    idle_timeout_s: float = Field(
        30.0, gt=0, description="Trainer: stop once no rank received a record this long (the stream ended or stalled)."
    )
    fill_timeout_s: float = Field(
        0.5,
        gt=0,
        description="How long a rank waits for a full batch before training "
        "the records it has (a starved partition waits this long).",
    )
    eval_every_steps: int = Field(200, ge=1, description="Evaluate on the held-out topic every this many steps.")
    eval_records: int = Field(
        2000,
        ge=2,
        description="Held-out records (half validation, half test): a topic of their own beside kbit's stream, or "
        "the first records of a user's topic (source.topic).",
    )
    report_every_steps: int = Field(20, ge=1, description="Lag, freshness and throughput window, in steps.")
    lag_growth_windows: int = Field(
        5, ge=1, description="Warn when the least lag of a block of this many windows rose over three blocks in a row."
    )

    @model_validator(mode="after")
    def _check_start(self) -> StreamConfig:
        if self.start == "timestamp" and self.start_timestamp_ms is None:
            raise ValueError("stream.start=timestamp needs stream.start_timestamp_ms")
        if self.start == "offsets" and not self.start_offsets:
            raise ValueError("stream.start=offsets needs stream.start_offsets (partition -> offset)")
        return self

    def topic_for(self, dataset: DatasetConfig, produce: ProduceConfig) -> str:
        if self.topic:
            return self.topic
        return f"{produce.topic_prefix}.stream.{dataset.source_name}.s{dataset.seed}.{produce.variant.name}.p{produce.partitions}"


class DeepSpeedConfig(Section):
    enabled: bool = False
    zero_stage: int = Field(1, ge=0, le=3)
    offload_optimizer: bool = False
    offload_param: bool = False
    activation_checkpointing: bool = False
    raw: dict[str, Any] | None = Field(None, description="A DeepSpeed JSON config that overrides the generated one.")

    @model_validator(mode="after")
    def _check_offload(self) -> DeepSpeedConfig:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param needs zero_stage 3")
        if self.offload_optimizer and self.zero_stage < 1:
            raise ValueError("deepspeed.offload_optimizer needs zero_stage >= 1")
        return self


class CheckpointConfig(Section):
    dir: Path | None = Field(None, description="Where checkpoints go; unset disables checkpointing.")
    every_steps: int | None = Field(None, ge=1)
    every_epoch: bool = True
    keep_last: int = Field(3, ge=1)
    async_save: bool = False
    resume: str = Field("none", description="'none', 'latest', or a checkpoint path.")
    max_restarts: int = Field(0, ge=0)
    keep_best: str | None = Field(
        None,
        description="An epoch metric (val_accuracy, val_loss, val_<train.metrics name>, train_loss ...): the epoch "
        "checkpoint where it was best is kept besides the last keep_last, and is the model logged to MLflow.",
    )
    keep_best_mode: Literal["max", "min"] | None = Field(
        None, description="Whether higher or lower is better; unset: min for names ending in loss or error, else max."
    )

    @model_validator(mode="after")
    def _check_keep_best(self) -> CheckpointConfig:
        if self.keep_best is not None and (self.dir is None or not self.every_epoch):
            raise ValueError("checkpoint.keep_best needs checkpoint.dir and checkpoint.every_epoch=true")
        return self

    def best_is_higher(self) -> bool:
        """Whether a higher ``keep_best`` value is better."""
        if self.keep_best_mode is not None:
            return self.keep_best_mode == "max"
        return not str(self.keep_best).endswith(("loss", "error"))

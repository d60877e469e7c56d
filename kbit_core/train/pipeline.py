"""Pipeline parallelism: DeepSpeed's PipelineModule cut into ``train.pipeline.stages`` stages × data parallel.

DeepSpeed lays ranks out pipe-major: rank = stage × data_parallel_size + data_parallel_rank. Only the first stage
of each pipeline reads data (kbit_core/train/layout.py). The labels travel with the activations from stage to
stage (a non-float tensor gets no gradient), so the last stage, which computes the loss, reads nothing either.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.train.distributed import DistEnv
from kbit_core.train.engine import DeepSpeedEngine
from kbit_core.train.layout import data_layout
from kbit_core.train.metrics import BatchStats, batch_sums, reduce_sums
from kbit_core.train.user_code import LossFn


class CarryLabels(nn.Module):
    """One layer of the pipeline: applies ``layer`` to the activations and passes the labels on unchanged."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        activations, labels = inputs
        return self.layer(activations), labels


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a flat sequence of layers: its ``layers()`` (the built-in transformers), or an nn.Sequential."""
    if hasattr(model, "layers"):
        return list(model.layers())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise ConfigError(
        f"train.pipeline.stages needs a model that is a sequence of layers (vit, token_transformer, an nn.Sequential, "
        f"or a model with a layers() method); {type(model).__name__} is neither"
    )


class PipelineEngine(DeepSpeedEngine):
    """DeepSpeed's pipeline engine: each loop step is one ``train_batch`` of ``train.pipeline.micro_batches``."""

    def __init__(
        self,
        deepspeed: ModuleType,
        model: nn.Module,
        cfg: KbitConfig,
        env: DistEnv,
        steps_per_epoch: int,
        total_steps: int,
    ) -> None:
        self.user_loss: LossFn = nn.functional.cross_entropy
        self.outputs: list[
            tuple[Tensor, Tensor, Tensor]
        ] = []  # the last stage's (loss, logits, labels) per micro-batch
        self.micro_batches = cfg.train.pipeline.micro_batches
        self.position = data_layout(cfg, env)
        super().__init__(deepspeed, model, cfg, env, steps_per_epoch, total_steps)
        self.name = f"deepspeed-pipeline-zero{cfg.deepspeed.zero_stage}"
        if (self.ds.stage_id, self.ds.grid.get_data_parallel_id()) != (
            self.position.model_parallel_rank,
            self.position.data_parallel_rank,
        ):
            raise ConfigError(f"DeepSpeed placed rank {env.rank} differently from kbit's pipe-major layout")

    def _prepare_model(
        self, deepspeed: ModuleType, model: nn.Module, cfg: KbitConfig, ds_config: dict[str, Any]
    ) -> nn.Module:
        # Every rank built the whole model from the same seed; PipelineModule keeps only this stage's layers, so
        # the stages together hold exactly the unsplit model's initial weights.
        return deepspeed.pipe.PipelineModule(
            layers=[CarryLabels(layer) for layer in model_layers(model)],
            num_stages=cfg.train.pipeline.stages,
            loss_fn=self._stage_loss,
            partition_method=cfg.train.pipeline.partition,
            dynamic_shape=True,  # evaluation batches may differ in size from training's micro-batches
        )

    def _stage_loss(self, outputs: tuple[Tensor, Tensor], _labels: Any) -> Tensor:
        logits, labels = outputs
        loss = self.user_loss(logits.float(), labels)
        self.outputs.append((loss.detach(), logits.detach().float(), labels))
        return loss

    def _micro_batches(self, x: Tensor, y: Tensor, count: int) -> Iterator[Any]:
        if self.position.model_parallel_rank == 0:
            return iter([((xs, ys), None) for xs, ys in zip(x.chunk(count), y.chunk(count), strict=True)])
        return repeat((None, None))

    def forward_backward(self, x: Tensor, y: Tensor, boundary: bool, loss_fn: LossFn) -> BatchStats:
        """The whole pipelined step (forward, backward and optimizer step of every micro-batch), then the global
        loss and accuracy: the last stage's sums, zeros from the others."""
        self.user_loss, self.outputs = loss_fn, []
        self.ds.train_batch(self._micro_batches(x, y, self.micro_batches))
        local = torch.zeros(4, dtype=torch.float64, device=self.ds.device)
        for loss, logits, labels in self.outputs:
            local += batch_sums(loss, logits, labels)
        return reduce_sums(local)

    def step(self) -> None:
        # train_batch already stepped the optimizer; only kbit's schedule is left.
        if self.ds.was_step_applied():
            self.scheduler.step()

    def export_weights(self, checkpoint: Path) -> None:
        """Not done: a pipeline checkpoint holds each stage's layers in files of its own, which zero_to_fp32 does
        not read; its model is not logged (the tracker says so)."""

    def eval_outputs(self, x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The last stage's (logits, labels) of one evaluation batch, as one micro-batch; none on other stages."""
        self.outputs = []
        self.ds.eval_batch(self._micro_batches(x, y, 1), num_micro_batches=1)
        return [(logits, labels) for _, logits, labels in self.outputs]

"""Tensor parallelism: torch's DTensor API splits each transformer block's attention and MLP across ranks.

``train.tensor_parallel.size`` ranks form one tensor-parallel group (consecutive ranks, the "tp" dimension of a
("dp", "tp") device mesh). In every block the query, key and value projections and the MLP's first layer are
split by output features (``ColwiseParallel``: whole heads, and a slice of the hidden units, per rank); the
attention's output projection and the MLP's second layer by input features (``RowwiseParallel``, whose forward
all-reduces the partial sums). Embedding, layer norms and head stay whole on every rank; their gradients agree
across the group because ColwiseParallel's backward all-reduces its input's gradient.

Only the group's first rank reads data (kbit_core/train/layout.py); it broadcasts each batch to the others. Data
parallelism across groups averages gradients over the "dp" dimension before each optimizer step (the sharded
parameters' local shards, the whole ones entirely). Checkpoints hold the whole model (gathered with
``torch.distributed.checkpoint.state_dict``), so they load into the unsplit model.

Over gloo on CPU (torch 2.13) every collective this needs exists: all-reduce, all-gather, broadcast (and, for
sequence parallelism or a parallel loss, reduce-scatter and all-reduce with AVG, also present) — measured in
tests/integration/test_train_parallel.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv
from kbit_core.train.engine import DDPEngine, checkpoint_blocks, wants_activation_checkpointing
from kbit_core.train.layout import data_layout
from kbit_core.train.metrics import BatchStats, batch_sums, reduce_sums
from kbit_core.train.transformer import EncoderBlock
from kbit_core.train.user_code import LossFn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# torch's DTensor, tensor-parallel and distributed-checkpoint modules take about a second to import: this module
# loads them where a tensor-parallel run uses them, not in every rank (and driver) that imports the engines.


def block_plan() -> dict[str, Any]:
    """Within an EncoderBlock: what each linear layer's weight is split by."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.3": RowwiseParallel(),
    }


def splittable_blocks(model: nn.Module, size: int) -> list[EncoderBlock]:
    """The EncoderBlocks of ``model`` that ``size`` tensor-parallel ranks split; ConfigError when it has none, or
    when their heads or hidden units do not split evenly (the driver's preflight asks too)."""
    blocks = [module for module in model.modules() if isinstance(module, EncoderBlock)]
    if not blocks:
        raise ConfigError(
            f"train.tensor_parallel needs a transformer (vit, token_transformer, or a model built of "
            f"kbit_core.train.transformer.EncoderBlock); {type(model).__name__} has no EncoderBlock"
        )
    for block in blocks:
        heads, hidden = block.attn.q.out_features // block.attn.head_dim, block.mlp[0].out_features
        if heads % size or hidden % size:
            raise ConfigError(
                f"train.tensor_parallel.size={size} does not divide the model's {heads} heads and {hidden} MLP units"
            )
    return blocks


def parallelize_blocks(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split every EncoderBlock of ``model`` over the 1-D ``mesh`` (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in splittable_blocks(model, mesh.size()):
        parallelize_module(block, mesh, block_plan())
    return model


class TensorParallelEngine(DDPEngine):
    """The DDP engine's optimizer, schedule and checkpoints around a DTensor-parallel model (no DDP wrapper)."""

    name = "tensor-parallel"

    def __init__(self, model: nn.Module, cfg: KbitConfig, env: DistEnv, steps_per_epoch: int, total_steps: int):
        from torch.distributed.device_mesh import init_device_mesh

        self.layout = data_layout(cfg, env)
        self.mesh = init_device_mesh(
            env.device.type,
            (self.layout.data_parallel_size, cfg.train.tensor_parallel.size),
            mesh_dim_names=("dp", "tp"),
        )
        self.module = parallelize_blocks(model.to(env.device), self.mesh["tp"])
        if wants_activation_checkpointing(cfg):
            checkpoint_blocks(self.module)  # after splitting: the plan names the blocks' own layers
        self.ddp = self.module
        self._build_training_state(cfg, env, self.layout.data_parallel_size, steps_per_epoch, total_steps)

    def accumulation(self, boundary: bool) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # gradients are averaged over "dp" in step(), so nothing to hold back

    def share_batch(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The group reader's (x, y) on every rank of its tensor-parallel group."""
        group = self.mesh.get_group("tp")
        meta = [(x.shape, x.dtype, y.shape, y.dtype) if self.layout.reads else None]
        dist.broadcast_object_list(meta, group=group, group_src=0)
        x_shape, x_dtype, y_shape, y_dtype = meta[0]
        if not self.layout.reads:
            x, y = (
                torch.empty(x_shape, dtype=x_dtype, device=x.device),
                torch.empty(y_shape, dtype=y_dtype, device=y.device),
            )
        dist.broadcast(x, group=group, group_src=0)
        dist.broadcast(y, group=group, group_src=0)
        return x, y

    def forward_backward(self, x: Tensor, y: Tensor, boundary: bool, loss_fn: LossFn) -> BatchStats:
        """One micro-batch of the group's batch; loss and accuracy counted once per group (by its reader)."""
        x, y = self.share_batch(x, y)
        logits = self.forward(x)
        loss = loss_fn(logits.float(), y)
        local = batch_sums(loss, logits, y)
        stats = reduce_sums(local if self.layout.reads else torch.zeros_like(local))
        if stats.finite:
            self.backward(loss)
        return stats

    def eval_outputs(self, x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The group's logits, reported by its reader only."""
        x, y = self.share_batch(x, y)
        logits = self.predict(x).float()
        return [(logits, y)] if self.layout.reads else []

    def step(self) -> None:
        if self.layout.data_parallel_size > 1:
            self._average_gradients_over_data_parallel()
        super().step()

    def _average_gradients_over_data_parallel(self) -> None:
        from torch.distributed.tensor import DTensor

        group = self.mesh.get_group("dp")
        for parameter in self.module.parameters():
            if parameter.grad is not None:
                grad = parameter.grad
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, dist.ReduceOp.AVG, group)

    def state_dict(self) -> dict[str, Any]:
        """Collective: the whole model and optimizer state on rank 0 (empty elsewhere), with the schedule's."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optimizer_state = get_state_dict(
            self.module, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {
            ckpt.MODEL: model_state,
            ckpt.OPTIMIZER: optimizer_state,
            ckpt.SCHEDULER: self.scheduler.state_dict(),
            ckpt.GRAD_SCALER: None,
            ckpt.EMA: None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state[ckpt.MODEL],
            optim_state_dict=state[ckpt.OPTIMIZER],
            options=StateDictOptions(full_state_dict=True),
        )
        self.scheduler.load_state_dict(state[ckpt.SCHEDULER])

    def save_checkpoint(self, writer: ckpt.Checkpointer | None, name: str, meta: dict[str, Any]) -> Path | None:
        state = self.state_dict()  # every rank takes part in gathering the shards
        return writer.write_file(name, {**state, **meta}) if writer is not None else None

"""DDP and DeepSpeed engines behind one small interface: accumulate, forward, backward, step, predict, checkpoint.

The loop never branches on the engine. Each engine owns its model, optimizer, LR schedule, loss scaler and
EMA copy, and knows how to save them (DDP: one rank-0 file; DeepSpeed: its own sharded checkpoint).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError, DistributedError
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.deepspeed_checkpoint import (
    consolidated_fp32_state_dict,
    convert_to_universal,
    load_universal,
    use_weights_only_loading,
)
from kbit_core.train.deepspeed_config import build_deepspeed_config, engine_name
from kbit_core.train.distributed import DistEnv, broadcast_from_main
from kbit_core.train.elastic import check_elastic
from kbit_core.train.ema import build_ema
from kbit_core.train.metrics import BatchStats, reduce_batch
from kbit_core.train.optim import build_optimizer, build_scheduler, effective_lr
from kbit_core.train.precision import Precision
from kbit_core.train.user_code import LossFn


class Engine(ABC):
    """One rank's model + optimizer + schedule, wrapped for data parallelism."""

    name: str

    @abstractmethod
    def accumulation(self, boundary: bool) -> contextlib.AbstractContextManager[object]:
        """Context for one micro-batch's forward and backward; gradients are synchronised only at a boundary."""

    @abstractmethod
    def forward(self, x: Tensor) -> Tensor:
        """Training forward pass: logits for a float32 batch."""

    @abstractmethod
    def backward(self, loss: Tensor) -> None:
        """Back-propagate one micro-batch's mean loss (scaled by 1/grad_accum_steps)."""

    @abstractmethod
    def step(self) -> None:
        """Optimizer step (with clipping, loss scaling, LR schedule and EMA update), then clear gradients."""

    @abstractmethod
    def predict(self, x: Tensor) -> Tensor:
        """Evaluation logits, from the EMA weights when enabled; call under torch.no_grad()."""

    @abstractmethod
    def train(self, mode: bool = True) -> None:
        """Switch the trained model (and EMA copy) between train and eval mode."""

    @abstractmethod
    def save_checkpoint(self, writer: ckpt.Checkpointer | None, name: str, meta: dict[str, Any]) -> Path | None:
        """Collective: save everything needed to resume; the checkpoint's path on rank 0, None elsewhere.

        ``writer`` and ``meta`` are needed on rank 0 only.
        """

    @abstractmethod
    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Collective: restore from ``path`` and return its meta (train state and per-rank entries)."""

    @abstractmethod
    def current_lr(self) -> float:
        """Learning rate of the first parameter group."""

    def forward_backward(self, x: Tensor, y: Tensor, boundary: bool, loss_fn: LossFn) -> BatchStats:
        """One micro-batch: forward, the global loss and accuracy, backward unless a rank's loss is not finite."""
        with self.accumulation(boundary):
            logits = self.forward(x)
            loss = loss_fn(logits.float(), y)
            stats = reduce_batch(loss, logits, y)
            if stats.finite:
                self.backward(loss)
        return stats

    def eval_outputs(self, x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Evaluation (logits, targets) pairs for one batch on this rank (none on a rank that computes no logits)."""
        return [(self.predict(x).float(), y)]

    @abstractmethod
    def export_weights(self, checkpoint: Path) -> None:
        """Rank 0, after training: make ``checkpoint`` loadable as a whole model (see ckpt.load_model)."""


class DDPEngine(Engine):
    """torch DistributedDataParallel with autocast, GradScaler (fp16), clipping, no_sync accumulation and EMA."""

    name = "ddp"

    def __init__(self, model: nn.Module, cfg: KbitConfig, env: DistEnv, steps_per_epoch: int, total_steps: int):
        train = cfg.train
        if env.device.type == "cuda" and train.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if wants_activation_checkpointing(cfg):
            model = checkpoint_blocks(model)
        self.module = model.to(env.device)
        self.ddp = DistributedDataParallel(self.module, device_ids=[env.device] if env.device.type == "cuda" else None)
        self._build_training_state(cfg, env, env.world_size, steps_per_epoch, total_steps)

    def _build_training_state(
        self, cfg: KbitConfig, env: DistEnv, data_parallel_size: int, steps_per_epoch: int, total_steps: int
    ) -> None:
        """Optimizer (over ``self.module``'s parameters as wrapped), schedule, precision, loss scaler and EMA."""
        train = cfg.train
        lr = effective_lr(train.optim, data_parallel_size, train.grad_accum_steps)
        self.optimizer = build_optimizer(self.module.parameters(), train.optim, lr)
        self.scheduler = build_scheduler(self.optimizer, train.optim, steps_per_epoch, total_steps)
        self.precision = Precision(train.precision, env.device)
        self.scaler = self.precision.grad_scaler()
        self.ema = build_ema(self.module, train.ema_decay) if train.ema_decay else None
        self.grad_accum_steps = train.grad_accum_steps
        self.grad_clip_norm = train.grad_clip_norm

    def accumulation(self, boundary: bool) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if boundary else self.ddp.no_sync()

    def forward(self, x: Tensor) -> Tensor:
        with self.precision.autocast():
            return self.ddp(x)

    def backward(self, loss: Tensor) -> None:
        loss = loss / self.grad_accum_steps
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip_norm:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.module)

    def predict(self, x: Tensor) -> Tensor:
        model = self.ema.module if self.ema is not None else self.module
        with self.precision.autocast():
            return model(x)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)
        if self.ema is not None:
            self.ema.train(mode)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            ckpt.MODEL: self.module.state_dict(),
            ckpt.OPTIMIZER: self.optimizer.state_dict(),
            ckpt.SCHEDULER: self.scheduler.state_dict(),
            ckpt.GRAD_SCALER: self.scaler.state_dict() if self.scaler else None,
            ckpt.EMA: self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state[ckpt.MODEL])
        self.optimizer.load_state_dict(state[ckpt.OPTIMIZER])
        self.scheduler.load_state_dict(state[ckpt.SCHEDULER])
        if self.scaler and state[ckpt.GRAD_SCALER] is not None:
            self.scaler.load_state_dict(state[ckpt.GRAD_SCALER])
        if self.ema is not None:
            if state[ckpt.EMA] is None:
                raise ConfigError("train.ema_decay is set but the checkpoint being resumed has no EMA weights")
            self.ema.load_state_dict(state[ckpt.EMA])

    def save_checkpoint(self, writer: ckpt.Checkpointer | None, name: str, meta: dict[str, Any]) -> Path | None:
        # Every rank holds identical weights after the all-reduce, so rank 0 alone writes.
        if writer is None:
            return None
        return writer.write_file(name, {**self.state_dict(), **meta})

    def export_weights(self, checkpoint: Path) -> None:
        """Nothing to do: a DDP checkpoint file holds the whole model."""

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        if ckpt.is_sharded(path):
            raise ConfigError(f"{path} is a DeepSpeed checkpoint; resume it with deepspeed.enabled=true")
        state = ckpt.read_file(path)
        self.load_state_dict(state)
        return {ckpt.TRAIN_STATE: state[ckpt.TRAIN_STATE], ckpt.RANKS: state[ckpt.RANKS]}


class DeepSpeedEngine(Engine):
    """A DeepSpeed ZeRO engine around a plain torch optimizer; the loop sets accumulation boundaries itself."""

    def __init__(
        self,
        deepspeed: ModuleType,
        model: nn.Module,
        cfg: KbitConfig,
        env: DistEnv,
        steps_per_epoch: int,
        total_steps: int,
    ):
        train, ds = cfg.train, cfg.deepspeed
        if train.ema_decay and ds.zero_stage == 3:
            raise ConfigError("train.ema_decay needs whole parameters on every rank; it does not work with ZeRO-3")
        self.name = engine_name(cfg)
        self.cfg, self.env = cfg, env
        ds_config = build_deepspeed_config(cfg, env.world_size, env.device.type == "cuda")
        model = self._prepare_model(deepspeed, model, cfg, ds_config)
        optimizer = build_optimizer(
            model.parameters(), train.optim, effective_lr(train.optim, env.world_size, train.grad_accum_steps)
        )
        # Built on the client optimizer: DeepSpeed's wrappers share its param_groups, so the LR set here is used.
        self.scheduler = build_scheduler(optimizer, train.optim, steps_per_epoch, total_steps)
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        use_weights_only_loading(self.ds)
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision, torch.float32)
        if self.input_dtype != torch.float32:
            _match_buffers_to_parameters(self.ds.module)
        self.ema = build_ema(self.ds.module, train.ema_decay) if train.ema_decay else None

    def _prepare_model(
        self, deepspeed: ModuleType, model: nn.Module, cfg: KbitConfig, ds_config: dict[str, Any]
    ) -> nn.Module:
        """The module DeepSpeed wraps: ``model``, its blocks checkpointed when asked."""
        if not wants_activation_checkpointing(cfg):
            return model
        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
        # The non-reentrant form: the reentrant one drops the graph when a block's input needs no grad (images).
        return checkpoint_blocks(model, deepspeed.checkpointing.non_reentrant_checkpoint)

    def accumulation(self, boundary: bool) -> contextlib.AbstractContextManager[object]:
        self.ds.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def forward(self, x: Tensor) -> Tensor:
        return self.ds(self._input(x))

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)  # divides by gradient_accumulation_steps itself

    def step(self) -> None:
        self.ds.step()
        # fp16 dynamic loss scaling skips overflowing steps; the schedule must not advance for those.
        if self.ds.was_step_applied():
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update_parameters(self.ds.module)

    def predict(self, x: Tensor) -> Tensor:
        model = self.ema.module if self.ema is not None else self.ds
        return model(self._input(x))

    def _input(self, x: Tensor) -> Tensor:
        """Images in the engine's precision; token ids stay integers (an embedding looks them up)."""
        return x.to(self.input_dtype) if x.is_floating_point() else x

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)
        if self.ema is not None:
            self.ema.train(mode)

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save_checkpoint(self, writer: ckpt.Checkpointer | None, name: str, meta: dict[str, Any]) -> Path | None:
        # All ranks write their shards; only rank 0 holds the writer, so it tells the others where.
        directory = broadcast_from_main(str(writer.directory) if writer is not None else None)
        client_state = {
            ckpt.SCHEDULER: self.scheduler.state_dict(),
            ckpt.EMA: self.ema.state_dict() if self.ema is not None else None,
        }
        self.ds.save_checkpoint(directory, tag=name, client_state=client_state, save_latest=False)
        torch.distributed.barrier()
        if writer is None:
            return None
        return writer.write_side_file(name, meta)

    def export_weights(self, checkpoint: Path) -> None:
        """Write the whole model's fp32 weights, consolidated from the ZeRO shards, into the checkpoint directory."""
        ckpt.write_consolidated(checkpoint, consolidated_fp32_state_dict(checkpoint))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Collective: restore from the DeepSpeed checkpoint directory ``path``; one written by another number of
        ranks loads through its universal form (see :meth:`_load_elastic`)."""
        if not ckpt.is_sharded(path):
            raise ConfigError(f"{path} is a DDP checkpoint file; resume it with deepspeed.enabled=false")
        meta = ckpt.read_side_file(path)
        written_by = len(meta[ckpt.RANKS])
        if written_by != self.env.world_size:
            client_state = self._load_elastic(path, written_by)
        else:
            loaded, client_state = self.ds.load_checkpoint(
                str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            if loaded is None:
                raise DistributedError(f"DeepSpeed could not load the checkpoint {path}")
        self.scheduler.load_state_dict(client_state[ckpt.SCHEDULER])
        if self.ema is not None:
            if client_state.get(ckpt.EMA) is None:
                raise ConfigError("train.ema_decay is set but the checkpoint being resumed has no EMA weights")
            self.ema.load_state_dict(client_state[ckpt.EMA])
        return meta

    def _load_elastic(self, path: Path, written_by: int) -> dict[str, Any]:
        """Collective: ZeRO partitions each parameter's fp32 copy and Adam moments over the ranks that wrote
        ``path``; rank 0 converts it to DeepSpeed's universal checkpoint (once, kept inside it), which every rank
        then loads re-partitioned for this run. Returns the client state."""
        check_elastic(self.cfg, path, written_by, self.env.world_size)
        converted: dict[str, str] = {}
        if self.env.is_main:
            try:
                converted["path"] = str(convert_to_universal(path))
            except Exception as exc:  # handed to the other ranks, which would otherwise wait for the path
                converted["error"] = f"{type(exc).__name__}: {exc}"
                broadcast_from_main(converted)
                raise
        converted = broadcast_from_main(converted)
        if "error" in converted:
            raise DistributedError(f"rank 0 could not convert {path} to a universal checkpoint: {converted['error']}")
        return load_universal(self.ds, Path(converted["path"]))


def wants_activation_checkpointing(cfg: KbitConfig) -> bool:
    """train.activation_checkpointing for every engine; deepspeed.activation_checkpointing, its older name."""
    return cfg.train.activation_checkpointing or cfg.deepspeed.activation_checkpointing


def checkpoint_blocks(model: nn.Module, checkpoint_fn: Any = None) -> nn.Module:
    """Recompute activations in backward, one block at a time: each top-level child (the model's stages), and each
    member of a top-level ModuleList (a transformer's blocks).

    torch's checkpoint wrapper keeps the plain model's parameter and state-dict names, so checkpoints and exported
    weights load into an unwrapped model. ``checkpoint_fn``: DeepSpeed's; unset, torch's non-reentrant checkpoint.
    """
    for child_name, child in list(model.named_children()):
        if isinstance(child, nn.ModuleList):
            for index, block in enumerate(child):
                child[index] = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn)
        else:
            setattr(model, child_name, checkpoint_wrapper(child, checkpoint_fn=checkpoint_fn))
    return model


def _match_buffers_to_parameters(model: nn.Module) -> None:
    """Give each module's floating-point buffers its parameters' dtype.

    DeepSpeed's fp16/bf16 modes cast parameters but not buffers, and CUDA's batch norm refuses a half weight
    with float running statistics ("Expected running_mean to have type Half but got Float").
    """
    for module in model.modules():
        dtypes = {p.dtype for p in module.parameters(recurse=False)}
        if len(dtypes) != 1:
            continue
        dtype = dtypes.pop()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))

"""The flat train loop: epochs of accumulated micro-batches, validation, checkpoints, resume, final test."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from tqdm import tqdm

from kbit_core.config import KbitConfig
from kbit_core.data.batching import to_device
from kbit_core.data.loader import LoaderStats
from kbit_core.data.split_loaders import SplitLoaderSet
from kbit_core.errors import ConfigError, DistributedError, TrainingDivergedError
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv, broadcast_from_main, gather_to_main
from kbit_core.train.elastic import check_elastic
from kbit_core.train.engine import Engine
from kbit_core.train.metrics import BatchStats, SpikeDetector, reduce_throughput, stand_in_step
from kbit_core.train.run_report import data_report, epoch_line, history_table, plan_line
from kbit_core.train.user_code import resolve_loss, resolve_metrics

log = logging.getLogger(__name__)

# One step's (x, y) as a loader yields it (a ShardLoader drops its batches' sample indices here).
LabelledInputs = tuple[torch.Tensor, torch.Tensor]


class Loader(Protocol):
    """What the loop needs from a split loader (kbit_core.data.loader.ShardLoader satisfies it)."""

    stats: LoaderStats

    def __iter__(self) -> Iterator[LabelledInputs]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


@dataclass
class SplitLoaders:
    """This rank's loaders; val and test are absent when shard.split_rates has fewer entries."""

    train: Loader
    val: Loader | None = None
    test: Loader | None = None
    # Per split: the shard plan's messages, messages_per_rank and PLAN_COUNTS for one epoch (the same on every
    # rank); empty when the loaders do not read a planned topic.
    plan: dict[str, dict[str, int]] = field(default_factory=dict)
    # The one reader set every split reads through, when the loaders share a consumer (the benchmark's).
    shared: SplitLoaderSet | None = None

    def splits(self) -> dict[str, Loader]:
        """The loaders present, by split name."""
        named = {"train": self.train, "val": self.val, "test": self.test}
        return {name: loader for name, loader in named.items() if loader is not None}

    def close(self) -> None:
        """Release the loaders' consumers and cached shards."""
        for loader in self.splits().values():
            loader.close()
        if self.shared is not None:
            self.shared.close()


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must carry, as plain JSON-able values."""

    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of `epoch` already trained
    step: int = 0  # optimizer steps taken
    skipped_batches: int = 0  # non-finite micro-batches dropped under nan_policy=skip
    epoch_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss_sum, correct, count so far
    history: list[dict[str, Any]] = field(default_factory=list)
    loss_curve: list[float] = field(default_factory=list)
    # checkpoint.keep_best: {"metric", "value", "epoch", "step"} of the best epoch so far
    best: dict[str, Any] | None = None


def batches_per_epoch(cfg: KbitConfig, loader_length: int) -> int:
    """Micro-batches trained per epoch: the loader's length, capped by train.max_steps_per_epoch."""
    cap = cfg.train.max_steps_per_epoch
    return loader_length if cap is None else min(loader_length, cap * cfg.train.grad_accum_steps)


def steps_per_epoch(cfg: KbitConfig, loader_length: int) -> int:
    """Optimizer steps per epoch (a trailing partial accumulation window still steps)."""
    return math.ceil(batches_per_epoch(cfg, loader_length) / cfg.train.grad_accum_steps)


class RankConsole(Console):
    """A rank's progress console. When whoever read its output is gone (a cancelled or killed driver), the rank
    must still reach its final checkpoint, so it goes quiet instead of exiting as rich does on a broken pipe."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:  # later writes and the interpreter's final flush of this stream go nowhere instead of failing
            os.dup2(devnull, self.file.fileno())
        finally:
            os.close(devnull)


class Trainer:
    """Runs one rank's share of training; every collective is reached by all ranks in the same order."""

    def __init__(
        self,
        cfg: KbitConfig,
        env: DistEnv,
        engine: Engine,
        loaders: SplitLoaders,
        checkpointer: ckpt.Checkpointer | None,
    ) -> None:
        self.cfg, self.env, self.engine, self.loaders = cfg, env, engine, loaders
        self.checkpointer = checkpointer  # rank 0 only
        self.state = TrainState()
        self.spikes = SpikeDetector(cfg.train.loss_spike_factor)
        self.console = RankConsole(stderr=False)
        self.last_checkpoint: str | None = None
        self.resumed: dict[str, Any] | None = None  # resume()'s checkpoint, the ranks that wrote it, its step
        self.loss_fn = resolve_loss(cfg.train)
        self.metric_fns = resolve_metrics(cfg.train)

    # ---- checkpoints -------------------------------------------------------------------------------------

    # The one save/resume of batch and continuous training: the engine writes the model and optimizer, the meta
    # carries the progress and one entry per rank (its RNG state and data position). What the progress and a data
    # position are is each trainer's own (the hooks below; StreamTrainer overrides them).

    def resume(self, path: Path) -> None:
        """Restore engine, progress, RNG and data position from ``path`` (every rank reads it)."""
        meta = self.engine.load_checkpoint(path)
        self._restore(path, meta)
        self.last_checkpoint = str(path)
        self.resumed = {
            "checkpoint": str(path),
            "written_by_ranks": len(meta[ckpt.RANKS]),
            "step": self._progress_step(),
        }
        if self.env.is_main:
            self.console.print(self._resumed_note(path, len(meta[ckpt.RANKS])))

    def save(self) -> None:
        """Collective: gather each rank's RNG state and data position, then let the engine write the checkpoint."""
        ranks = self._gather_ranks()
        path = self.engine.save_checkpoint(
            self.checkpointer, ckpt.checkpoint_name(self._progress_step()), self._checkpoint_meta(ranks)
        )
        self.last_checkpoint = str(path) if path is not None else None

    def _gather_ranks(self) -> list[dict[str, Any]] | None:
        """Collective: each rank's RNG state and data position, on rank 0 (None elsewhere)."""
        return gather_to_main({"rng": ckpt.rng_state(self.env.device), **self._data_position()}, self.env)

    def _progress_step(self) -> int:
        return self.state.step

    def _data_position(self) -> dict[str, Any]:
        """Where this rank's train loader stands: its state mid-epoch, nothing at an epoch's start."""
        return {"loader": self.loaders.train.state_dict() if self.state.batch_in_epoch > 0 else None}

    def _checkpoint_meta(self, ranks: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {ckpt.TRAIN_STATE: asdict(self.state), ckpt.RANKS: ranks}

    def _restore(self, path: Path, meta: dict[str, Any]) -> None:
        ranks = meta[ckpt.RANKS]
        self.state = TrainState(**meta[ckpt.TRAIN_STATE])
        if len(ranks) == self.env.world_size:
            mine = ranks[self.env.rank]
            ckpt.set_rng_state(mine["rng"], self.env.device)
            loader_state = mine["loader"]
        else:  # elastic: each rank keeps the random stream it was seeded with; the epoch's rest is re-planned
            check_elastic(self.cfg, path, len(ranks), self.env.world_size)
            loader_state = {"resharded_from": [rank["loader"] for rank in ranks]}
        if self.state.batch_in_epoch:
            self.loaders.train.set_epoch(self.state.epoch)
            self.loaders.train.load_state_dict(loader_state)
        for loss in self.state.loss_curve:
            self.spikes.observe(loss)
        if self.checkpointer is not None and self.state.best is not None:
            self.checkpointer.keep(ckpt.checkpoint_name(self.state.best["step"]))

    def _resumed_note(self, path: Path, num_ranks: int) -> str:
        elastic = (
            f", written by {num_ranks} ranks, now {self.env.world_size}" if num_ranks != self.env.world_size else ""
        )
        return (
            f"resumed from {path}: epoch {self.state.epoch}, batch {self.state.batch_in_epoch}, step {self.state.step}"
            f"{elastic}"
        )

    # ---- evaluation --------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, loader: Loader, epoch: int) -> dict[str, float]:
        """Global mean loss, accuracy and ``train.metrics`` of the (EMA, when enabled) model over ``loader``."""
        self.engine.train(False)
        loader.set_epoch(epoch)
        sums = torch.zeros(3 + len(self.metric_fns), dtype=torch.float64, device=self.env.device)
        for x, y in loader:
            x, y = to_device(x, y, self.env.device)
            for logits, targets in self.engine.eval_outputs(x, y):
                sums += self._eval_sums(logits, targets)
        torch.distributed.all_reduce(sums)
        self.engine.train(True)
        loss_sum, correct, count, *metric_sums = sums.tolist()
        if count == 0:
            raise DistributedError("evaluation loader yielded no samples on any rank")
        metrics = {name: total / count for name, total in zip(self.metric_fns, metric_sums, strict=True)}
        return {"loss": loss_sum / count, "accuracy": correct / count, **metrics}

    def _eval_sums(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One batch's [loss sum, correct, count, each metric's sum] on this rank."""
        count = float(targets.numel())
        values = [self.loss_fn(logits, targets).double() * count, (logits.argmax(dim=1) == targets).sum().double()]
        values.append(torch.tensor(count, dtype=torch.float64, device=self.env.device))
        for name, metric in self.metric_fns.items():
            per_sample = metric(logits, targets)
            if per_sample.shape != targets.shape:
                raise ConfigError(
                    f"train.metrics.{name} returned shape {tuple(per_sample.shape)}; it must return one value per "
                    f"sample, shape {tuple(targets.shape)}"
                )
            values.append(per_sample.double().sum())
        return torch.stack(values)

    # ---- training ----------------------------------------------------------------------------------------

    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Train the rest of ``epoch`` (from state.batch_in_epoch) and return its global train metrics."""
        train, st = self.cfg.train, self.state
        num_batches = batches_per_epoch(self.cfg, len(self.loaders.train))
        if st.batch_in_epoch == 0:
            self.loaders.train.set_epoch(epoch)
        batches: Iterator[LabelledInputs] = iter(self.loaders.train)
        window_loss = window_count = 0.0
        in_window = 0
        data_wait = 0.0
        start = time.perf_counter()
        trained_samples = 0.0
        progress = tqdm(
            total=num_batches,
            initial=st.batch_in_epoch,
            desc=f"epoch {epoch + 1}/{train.epochs}",
            disable=not (self.env.is_main and sys.stderr.isatty()),
            leave=False,
        )
        for index in range(st.batch_in_epoch, num_batches):
            fetch = time.perf_counter()
            x, y = self._next_batch(batches, epoch, index, len(self.loaders.train))
            x, y = to_device(x, y, self.env.device)
            data_wait += time.perf_counter() - fetch
            boundary = in_window + 1 == train.grad_accum_steps or index == num_batches - 1
            stats = self.forward_backward(x, y, boundary)
            st.batch_in_epoch = index + 1
            progress.update(1)
            if not stats.finite:
                self._diverged(epoch, index, stats.nonfinite_ranks)
                continue
            in_window += 1
            window_loss += stats.loss_sum
            window_count += stats.count
            trained_samples += stats.count
            st.epoch_sums = [
                st.epoch_sums[0] + stats.loss_sum,
                st.epoch_sums[1] + stats.correct,
                st.epoch_sums[2] + stats.count,
            ]
            if not boundary:
                continue
            self._optimizer_step(epoch, window_loss / window_count, progress, epoch_end=index == num_batches - 1)
            window_loss = window_count = 0.0
            in_window = 0
        progress.close()
        loss_sum, correct, count = st.epoch_sums
        speed = reduce_throughput(trained_samples, time.perf_counter() - start, data_wait, self.env.device)
        return {
            "loss": loss_sum / count if count else float("nan"),
            "accuracy": correct / count if count else 0.0,
            "samples_per_s": speed.samples_per_s,
            "data_wait_fraction": speed.data_wait_fraction,
            "peak_memory_mb": speed.peak_memory_mb,
        }

    def _optimizer_step(self, epoch: int, step_loss: float, progress: tqdm, epoch_end: bool) -> None:
        """Step the optimizer on the accumulated window; record its loss, watch for spikes, checkpoint when due."""
        st = self.state
        if self.cfg.train.stand_in_step_ms is None:  # a stand-in step leaves no gradients to apply
            self.engine.step()
        st.step += 1
        st.loss_curve.append(step_loss)
        running = self.spikes.observe(step_loss)
        if running is not None and self.env.is_main:
            log.warning(
                "loss spike at epoch %d step %d: %.4g > %.1f × running mean %.4g",
                epoch,
                st.step,
                step_loss,
                self.cfg.train.loss_spike_factor,
                running,
            )
        progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{self.engine.current_lr():.3g}")
        every = self.cfg.checkpoint.every_steps
        epoch_end_save = self.cfg.checkpoint.every_epoch and epoch_end
        if self.cfg.checkpoint.dir and every and st.step % every == 0 and not epoch_end_save:
            self.save()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, boundary: bool) -> BatchStats:
        """One micro-batch: forward, the global loss and accuracy, backward unless a rank's loss is not finite (with
        ``train.stand_in_step_ms``: the stand-in step instead, the same on every rank)."""
        stand_in = self.cfg.train.stand_in_step_ms
        if stand_in is not None:
            return stand_in_step(stand_in, len(y) * self.env.world_size)
        return self.engine.forward_backward(x, y, boundary, self.loss_fn)

    def _next_batch(self, batches: Iterator[LabelledInputs], epoch: int, index: int, length: int) -> LabelledInputs:
        try:
            return next(batches)
        except StopIteration:
            raise DistributedError(
                f"train loader ended after {index} batches in epoch {epoch}, but its len() "
                f"is {length}: ranks would fall out of step"
            ) from None

    def _diverged(self, epoch: int, index: int, ranks: int) -> None:
        """A non-finite loss on ``ranks`` ranks: fail, or drop the micro-batch everywhere and count it."""
        where = f"epoch {epoch}, batch {index} (optimizer step {self.state.step + 1})"
        if self.cfg.train.nan_policy == "fail":
            raise TrainingDivergedError(
                f"loss is NaN/inf at {where} on {ranks} rank(s); "
                "lower the learning rate, enable grad_clip_norm, or set train.nan_policy=skip"
            )
        self.state.skipped_batches += 1
        if self.env.is_main:
            log.warning("skipped a non-finite loss at %s (%d skipped so far)", where, self.state.skipped_batches)

    def fit(self) -> dict[str, Any]:
        """Train the remaining epochs, validating (and checkpointing) after each, then test once."""
        self._print_plan()
        st = self.state
        while st.epoch < self.cfg.train.epochs:
            epoch = st.epoch
            epoch_start = time.perf_counter()
            metrics = {"epoch": epoch, **{f"train_{k}": v for k, v in self.train_epoch(epoch).items()}}
            if self.loaders.val is not None:
                metrics.update({f"val_{k}": v for k, v in self.evaluate(self.loaders.val, epoch).items()})
            metrics["epoch_seconds"] = time.perf_counter() - epoch_start
            metrics["steps"] = st.step
            st.history.append(metrics)
            st.epoch, st.batch_in_epoch, st.epoch_sums = epoch + 1, 0, [0.0, 0.0, 0.0]
            self._print_epoch(metrics)
            if self.cfg.checkpoint.dir and self.cfg.checkpoint.every_epoch:
                self._track_best(metrics)
                self.save()
        if self.checkpointer is not None:
            self.checkpointer.wait()
            model_checkpoint = self._model_checkpoint()
            if model_checkpoint is not None:
                self.engine.export_weights(model_checkpoint)
        test = self.evaluate(self.loaders.test, st.epoch) if self.loaders.test is not None else None
        return self._result(test)

    def _track_best(self, metrics: dict[str, Any]) -> None:
        """checkpoint.keep_best: when this epoch's metric beats the best so far, the checkpoint about to be written
        becomes the one kept from pruning (its name is its step)."""
        name = self.cfg.checkpoint.keep_best
        if name is None:
            return
        if not isinstance(metrics.get(name), float):
            known = ", ".join(k for k, v in metrics.items() if isinstance(v, float))
            raise ConfigError(f"checkpoint.keep_best={name!r} is not an epoch metric of this run; these are: {known}")
        best, value = self.state.best, metrics[name]
        if best is None or (value > best["value"] if self.cfg.checkpoint.best_is_higher() else value < best["value"]):
            self.state.best = {"metric": name, "value": value, "epoch": metrics["epoch"], "step": self.state.step}
            if self.checkpointer is not None:
                self.checkpointer.keep(ckpt.checkpoint_name(self.state.step))

    def _model_checkpoint(self) -> Path | None:
        """Rank 0: the checkpoint whose model the run hands on (MLflow): the best one under keep_best, else the last."""
        if self.checkpointer is None:
            return None
        if self.state.best is not None:
            return self.checkpointer.find(ckpt.checkpoint_name(self.state.best["step"]))
        return Path(self.last_checkpoint) if self.last_checkpoint else None

    # ---- reporting ---------------------------------------------------------------------------------------

    def _print_plan(self) -> None:
        if self.env.is_main and self.loaders.plan:
            self.console.print(plan_line(self.loaders.plan))

    def _data_report(self) -> dict[str, dict[str, int]]:
        """Collective: per split, the read counts summed over ranks for this run's reads, and the plan's counts."""
        return data_report(self.loaders.splits(), self.loaders.plan, self.env.device)

    def _print_epoch(self, m: dict[str, Any]) -> None:
        if self.env.is_main:
            self.console.print(epoch_line(m, self.cfg.train.epochs))

    def _result(self, test: dict[str, float] | None) -> dict[str, Any]:
        st = self.state
        last = st.history[-1] if st.history else {}
        result = {
            "engine": self.engine.name,
            "backend": self.env.backend,
            "world_size": self.env.world_size,
            "epochs": st.epoch,
            "steps": st.step,
            "skipped_batches": st.skipped_batches,
            "test_loss": test["loss"] if test else None,
            "test_accuracy": test["accuracy"] if test else None,
            "train_loss": [h["train_loss"] for h in st.history],
            "train_accuracy": [h["train_accuracy"] for h in st.history],
            "val_loss": [h["val_loss"] for h in st.history if "val_loss" in h],
            "val_accuracy": [h["val_accuracy"] for h in st.history if "val_accuracy" in h],
            **{f"val_{name}": [h[f"val_{name}"] for h in st.history if f"val_{name}" in h] for name in self.metric_fns},
            **{f"test_{name}": test[name] if test else None for name in self.metric_fns},
            "pipeline_stages": self.cfg.train.pipeline.stages,
            "tensor_parallel_size": self.cfg.train.tensor_parallel.size,
            "data_parallel_size": self.env.world_size
            // (self.cfg.train.pipeline.stages * self.cfg.train.tensor_parallel.size),
            "samples_per_s": last.get("train_samples_per_s"),
            "data_wait_fraction": last.get("train_data_wait_fraction"),
            "peak_memory_mb": max((h["train_peak_memory_mb"] for h in st.history), default=None),
            "checkpoint": self.last_checkpoint,
            "resumed": self.resumed,
            "best": {**st.best, "checkpoint": str(self._model_checkpoint())} if st.best else None,
            "data": self._data_report(),
            "history": st.history,
            "loss_curve": st.loss_curve,
        }
        if self.env.is_main:
            self.console.print(history_table(st.history, test))
        return broadcast_from_main(result)

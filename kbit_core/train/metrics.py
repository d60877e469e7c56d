"""Metrics reduced across ranks: per-batch loss/accuracy sums, epoch throughput and data-wait share, memory, spikes."""

from __future__ import annotations

import resource
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class BatchStats:
    """One micro-batch summed over all ranks."""

    loss_sum: float
    correct: float
    count: float
    nonfinite_ranks: int

    @property
    def finite(self) -> bool:
        return self.nonfinite_ranks == 0


def stand_in_step(busy_ms: float, samples: float) -> BatchStats:
    """A training step that trains nothing: ``busy_ms`` of busy waiting in Python (holding the interpreter lock as a
    GPU step's launches do), then ``samples`` counted with no loss and nothing correct."""
    end = time.perf_counter() + busy_ms / 1000
    while time.perf_counter() < end:
        pass
    return BatchStats(0.0, 0.0, samples, 0)


def batch_sums(loss: Tensor, logits: Tensor, targets: Tensor) -> Tensor:
    """One micro-batch's [loss × count, correct, count, non-finite] on this rank, float64; a non-finite loss adds
    nothing to the loss sum and counts once in the last entry."""
    count = targets.numel()
    loss = loss.detach().double()
    finite = bool(torch.isfinite(loss))
    return torch.stack(
        [
            loss * count if finite else torch.zeros((), dtype=torch.float64, device=loss.device),
            (logits.detach().argmax(dim=1) == targets).sum().double(),
            torch.tensor(float(count), dtype=torch.float64, device=loss.device),
            torch.tensor(0.0 if finite else 1.0, dtype=torch.float64, device=loss.device),
        ]
    )


def reduce_sums(local: Tensor) -> BatchStats:
    """All-reduce this rank's :func:`batch_sums` (summed over its micro-batches, or zeros where a rank computed no
    loss: a pipeline's earlier stages), so every rank takes the same NaN/skip decision."""
    dist.all_reduce(local)
    loss_sum, correct, total, nonfinite = local.tolist()
    return BatchStats(loss_sum, correct, total, int(nonfinite))


def reduce_batch(loss: Tensor, logits: Tensor, targets: Tensor) -> BatchStats:
    """All-reduce one micro-batch's loss and accuracy over ranks."""
    return reduce_sums(batch_sums(loss, logits, targets))


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass(frozen=True)
class Throughput:
    samples_per_s: float
    data_wait_fraction: float
    peak_memory_mb: float


def reduce_throughput(samples: float, wall_s: float, data_wait_s: float, device: torch.device) -> Throughput:
    """Global samples/s (over the slowest rank's wall time), mean data-wait share, and the largest peak memory.

    ``samples`` is already global; ``wall_s`` and ``data_wait_s`` are this rank's.
    """
    sums = torch.tensor([data_wait_s, wall_s], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    maxima = torch.tensor([wall_s, peak_memory_mb(device)], dtype=torch.float64, device=device)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    wait_total, wall_total = sums.tolist()
    slowest_wall, peak = maxima.tolist()
    return Throughput(
        samples_per_s=samples / slowest_wall if slowest_wall > 0 else 0.0,
        data_wait_fraction=wait_total / wall_total if wall_total > 0 else 0.0,
        peak_memory_mb=peak,
    )


class SpikeDetector:
    """Flags a step loss above ``factor`` × the mean of the recent window (after a few steps of history)."""

    def __init__(self, factor: float, window: int = 50, min_history: int = 5) -> None:
        self.factor = factor
        self.min_history = min_history
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, loss: float) -> float | None:
        """Record ``loss``; return the running mean it exceeded when it is a spike, else None."""
        mean = sum(self.recent) / len(self.recent) if self.recent else None
        self.recent.append(loss)
        if mean is not None and len(self.recent) > self.min_history and loss > self.factor * mean:
            return mean
        return None

"""Pure bookkeeping of a live stream: which rank reads which partitions, which indices were trained, the audit.

The live producer sends stream index ``i`` to partition ``i % partitions``, so partition ``p`` holds the indices
``p, p + P, p + 2P, ...`` in offset order. A partition's trained indices are therefore kept as runs of stride
``P`` (``[first, last]``): one run per partition when nothing was skipped or repeated, and the audit compares
them with what the producer's manifest says it produced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kbit_core.errors import ConfigError

IndexRuns = list[list[int]]  # [[first, last], ...] of one partition, stride = the topic's partition count


def assign_partitions(num_partitions: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Partitions per rank: partition ``p`` goes to rank ``p % world_size``.

    The same (partitions, world size) always gives the same assignment, and every partition has exactly one
    rank; positions live per partition (not per rank), so any other world size takes them over unchanged.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if num_partitions < world_size:
        raise ConfigError(
            f"the stream has {num_partitions} partition(s) but launch.num_processes={world_size}: "
            f"every rank needs a partition of its own (raise produce.partitions)"
        )
    return tuple(tuple(range(rank, num_partitions, world_size)) for rank in range(world_size))


def add_run(runs: IndexRuns, first: int, last: int, stride: int) -> None:
    """Append the run ``first..last`` to ``runs``, merged into the last run when it continues it."""
    if runs and runs[-1][1] + stride == first:
        runs[-1][1] = last
    else:
        runs.append([first, last])


def extend_runs(runs: IndexRuns, indices: Iterable[int], stride: int) -> None:
    """Append ``indices`` (one partition's, in offset order) to ``runs``."""
    for index in indices:
        add_run(runs, index, index, stride)


def expand_runs(runs: Sequence[Sequence[int]], stride: int) -> np.ndarray:
    """Every index the runs cover, in order (repeats kept)."""
    parts = [np.arange(first, last + 1, stride, dtype=np.int64) for first, last in runs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class Audit:
    """What the trainer trained against what the producer produced, index by index."""

    produced: int
    trained: int
    missing: list[int] = field(default_factory=list)  # produced, never trained (at most the first 20)
    repeated: list[int] = field(default_factory=list)  # trained more than once (at most the first 20)
    unexpected: list[int] = field(default_factory=list)  # trained, never produced (at most the first 20)
    missing_count: int = 0
    repeated_count: int = 0
    unexpected_count: int = 0

    @property
    def exactly_once(self) -> bool:
        return not (self.missing_count or self.repeated_count or self.unexpected_count)

    def summary(self) -> str:
        if self.exactly_once:
            return f"exactly once: {self.trained} of {self.produced} produced records, each trained once"
        return (
            f"{self.missing_count} missing (first {self.missing}), {self.repeated_count} trained more than "
            f"once (first {self.repeated}), {self.unexpected_count} never produced (first {self.unexpected}); "
            f"{self.trained} trained of {self.produced} produced"
        )


def audit(
    trained: Mapping[int, Sequence[Sequence[int]]], produced: Mapping[int, Sequence[Sequence[int]]], num_partitions: int
) -> Audit:
    """Compare trained and produced index runs (both per partition, stride ``num_partitions``)."""

    def flat(per_partition: Mapping[int, Sequence[Sequence[int]]]) -> np.ndarray:
        parts = [expand_runs(runs, num_partitions) for runs in per_partition.values()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    done, made = flat(trained), np.unique(flat(produced))
    values, counts = np.unique(done, return_counts=True)
    missing = np.setdiff1d(made, values)
    repeated = values[counts > 1]
    unexpected = np.setdiff1d(values, made)
    return Audit(
        produced=len(made),
        trained=len(done),
        missing=missing[:20].tolist(),
        repeated=repeated[:20].tolist(),
        unexpected=unexpected[:20].tolist(),
        missing_count=len(missing),
        repeated_count=len(repeated),
        unexpected_count=len(unexpected),
    )


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[int] = (50, 95, 99)) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of ``values`` (None each when there are none)."""
    data = np.asarray(values, dtype=np.float64)
    return {f"p{q}": (float(np.percentile(data, q)) if data.size else None) for q in qs}


def lag_grows(totals: Sequence[float], windows: int) -> bool:
    """Whether the lag grows without bound: its floor (the least lag in a block of ``windows`` report windows) rose
    over each of the last three blocks. The floor, because a producer that sends in bursts makes the lag a saw
    tooth that a trainer keeping up still rides."""
    recent = list(totals)[-3 * windows :]
    if len(recent) < 3 * windows:
        return False
    floors = [min(recent[i : i + windows]) for i in range(0, 3 * windows, windows)]
    return floors[0] < floors[1] < floors[2]

"""Rank configurations against the fastest one, and flag regressions between two benchmark runs.

"Faster" is decided on medians with a two-sided Mann–Whitney U test, never on means alone (asv's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from scipy.stats import mannwhitneyu

from kbit_core.bench.stats import checked_samples
from kbit_core.errors import StatisticsError

Metric = Literal["load_time", "makespan"]


@dataclass(frozen=True)
class ConfigComparison:
    """One configuration measured against the fastest; ``p_value`` is None for the fastest itself."""

    name: str
    rank: int
    median: float
    ratio: float
    slowdown_pct: float
    p_value: float | None


@dataclass(frozen=True)
class Comparison:
    fastest: str
    slowest: str
    entries: tuple[ConfigComparison, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"fastest": self.fastest, "slowest": self.slowest,
                "ranking": [asdict(e) for e in self.entries]}


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Mann–Whitney U p-value (identical constant samples give 1.0, never NaN)."""
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


def compare_configs(samples: Mapping[str, Sequence[float]]) -> Comparison:
    """Rank configurations by median (ties: mean, then name) and compare each with the fastest."""
    if not samples:
        raise StatisticsError("no configurations to compare")
    arrays = {name: checked_samples(values, name) for name, values in samples.items()}
    order = sorted(arrays, key=lambda n: (float(np.median(arrays[n])), float(arrays[n].mean()), n))
    fastest = order[0]
    best = float(np.median(arrays[fastest]))
    if best <= 0:
        raise StatisticsError(f"configuration {fastest!r} has a non-positive median ({best}); ratios are undefined")
    entries = []
    for rank, name in enumerate(order, start=1):
        median = float(np.median(arrays[name]))
        entries.append(ConfigComparison(
            name=name, rank=rank, median=median, ratio=median / best, slowdown_pct=(median / best - 1) * 100,
            p_value=None if name == fastest else mann_whitney_p(arrays[fastest], arrays[name]),
        ))
    return Comparison(fastest=fastest, slowest=order[-1], entries=tuple(entries))


@dataclass(frozen=True)
class RunDelta:
    """One configuration in run A (baseline) and run B (candidate)."""

    name: str
    a_median: float
    b_median: float
    change_pct: float
    p_value: float
    regression: bool
    improvement: bool

    @property
    def verdict(self) -> str:
        return "regression" if self.regression else "improvement" if self.improvement else "same"


@dataclass(frozen=True)
class RunComparison:
    metric: Metric
    threshold: float
    alpha: float
    deltas: tuple[RunDelta, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]

    @property
    def regressions(self) -> tuple[RunDelta, ...]:
        return tuple(d for d in self.deltas if d.regression)

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "threshold": self.threshold, "alpha": self.alpha,
                "deltas": [{**asdict(d), "verdict": d.verdict} for d in self.deltas], "regressions": [d.name for d in self.regressions],
                "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b)}


def run_samples(stats_json: Mapping[str, Any], metric: Metric) -> dict[str, list[float]]:
    """The raw samples of ``metric`` per configuration from a stats JSON document (see docs/benchmark.md)."""
    try:
        raw = stats_json["raw_results"] if metric == "load_time" else stats_json["makespan"]["raw_results"]
    except (KeyError, TypeError):
        raise StatisticsError(f"stats document has no raw samples for metric {metric!r}") from None
    return {str(k): list(v) for k, v in raw.items()}


def compare_runs(a_stats_json: Mapping[str, Any], b_stats_json: Mapping[str, Any], threshold: float,
                 alpha: float = 0.05, metric: Metric = "load_time") -> RunComparison:
    """Compare run B against baseline run A per shared configuration.

    A regression is a B median slower than A's by more than ``threshold`` (relative, 0.10 = 10 %) *and*
    significant (Mann–Whitney p < ``alpha``); an improvement is the mirror image. Configurations present in
    only one run are listed, not compared.
    """
    if threshold <= 0:
        raise StatisticsError(f"regression threshold must be positive, got {threshold}")
    a_runs, b_runs = run_samples(a_stats_json, metric), run_samples(b_stats_json, metric)
    deltas = []
    for name in sorted(a_runs.keys() & b_runs.keys()):
        a, b = checked_samples(a_runs[name], f"A:{name}"), checked_samples(b_runs[name], f"B:{name}")
        a_med, b_med = float(np.median(a)), float(np.median(b))
        if a_med <= 0:
            raise StatisticsError(f"configuration {name!r} has a non-positive baseline median ({a_med})")
        change = b_med / a_med - 1
        p = mann_whitney_p(a, b)
        deltas.append(RunDelta(name=name, a_median=a_med, b_median=b_med, change_pct=change * 100, p_value=p,
                               regression=change > threshold and p < alpha,
                               improvement=change < -threshold and p < alpha))
    return RunComparison(metric=metric, threshold=threshold, alpha=alpha, deltas=tuple(deltas),
                         only_in_a=tuple(sorted(a_runs.keys() - b_runs.keys())),
                         only_in_b=tuple(sorted(b_runs.keys() - a_runs.keys())))

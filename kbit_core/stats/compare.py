"""Rank configurations against the fastest one, and flag regressions between two benchmark runs.

The unit of every test is one iteration (one TorchDistributor job): its makespan, or its mean over ranks.
The ranks of one iteration share the broker and the CPU, so they are not independent samples and never
enter a test as such. "Faster" is decided on medians with a two-sided Mann–Whitney U test (asv's rule),
Holm–Bonferroni corrected across the configurations tested together; a pair of run counts that cannot
reach significance after that correction is reported as "insufficient runs" instead of a p.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from kbit_core.errors import StatisticsError
from kbit_core.stats.samples import can_be_significant, checked_samples, holm_adjust, mann_whitney_p

Metric = Literal["makespan", "rank_mean"]
METRICS: tuple[Metric, ...] = ("makespan", "rank_mean")
ALPHA = 0.05
REFERENCE = "reference"
SIGNIFICANT = "significant"
NOT_SIGNIFICANT = "not significant"
INSUFFICIENT = "insufficient runs"


@dataclass(frozen=True)
class Significance:
    """One Mann–Whitney test of a family: raw and Holm-adjusted p (None when the runs cannot support a claim)."""

    p_value: float | None
    p_holm: float | None
    verdict: str


def tested_family(pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float) -> dict[str, Significance]:
    """Test every pair, Holm-correct the p-values of the pairs that have enough runs, and name each verdict."""
    testable = {
        name: pair for name, pair in pairs.items() if can_be_significant(pair[0].size, pair[1].size, len(pairs), alpha)
    }
    raw = {name: mann_whitney_p(a, b) for name, (a, b) in testable.items()}
    adjusted = dict(zip(raw, holm_adjust(list(raw.values()))))
    return {
        name: Significance(raw[name], adjusted[name], SIGNIFICANT if adjusted[name] < alpha else NOT_SIGNIFICANT)
        if name in raw
        else Significance(None, None, INSUFFICIENT)
        for name in pairs
    }


@dataclass(frozen=True)
class ConfigComparison:
    """One configuration measured against the fastest; the fastest itself is the ``reference``."""

    name: str
    rank: int
    runs: int
    median: float
    ratio: float
    slowdown_pct: float
    p_value: float | None
    p_holm: float | None
    significance: str


@dataclass(frozen=True)
class Comparison:
    fastest: str
    slowest: str
    alpha: float
    entries: tuple[ConfigComparison, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "fastest": self.fastest,
            "slowest": self.slowest,
            "alpha": self.alpha,
            "ranking": [asdict(e) for e in self.entries],
        }


def compare_configs(samples: Mapping[str, Sequence[float]], alpha: float = ALPHA) -> Comparison:
    """Rank configurations by the median of their per-iteration samples (ties: mean, then name) and test each
    against the fastest, Holm-corrected across all of them."""
    if not samples:
        raise StatisticsError("no configurations to compare")
    arrays = {name: checked_samples(values, name) for name, values in samples.items()}
    order = sorted(arrays, key=lambda n: (float(np.median(arrays[n])), float(arrays[n].mean()), n))
    fastest = order[0]
    best = float(np.median(arrays[fastest]))
    if best <= 0:
        raise StatisticsError(f"configuration {fastest!r} has a non-positive median ({best}); ratios are undefined")
    tests = tested_family({n: (arrays[fastest], arrays[n]) for n in order[1:]}, alpha)
    tests[fastest] = Significance(None, None, REFERENCE)
    entries = []
    for rank, name in enumerate(order, start=1):
        median = float(np.median(arrays[name]))
        t = tests[name]
        entries.append(
            ConfigComparison(
                name=name,
                rank=rank,
                runs=int(arrays[name].size),
                median=median,
                ratio=median / best,
                slowdown_pct=(median / best - 1) * 100,
                p_value=t.p_value,
                p_holm=t.p_holm,
                significance=t.verdict,
            )
        )
    return Comparison(fastest=fastest, slowest=order[-1], alpha=alpha, entries=tuple(entries))


@dataclass(frozen=True)
class RunDelta:
    """One configuration in run A (baseline) and run B (candidate)."""

    name: str
    a_runs: int
    b_runs: int
    a_median: float
    b_median: float
    change_pct: float
    p_value: float | None
    p_holm: float | None
    verdict: str

    @property
    def regression(self) -> bool:
        return self.verdict == "regression"

    @property
    def improvement(self) -> bool:
        return self.verdict == "improvement"


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

    @property
    def insufficient(self) -> tuple[RunDelta, ...]:
        return tuple(d for d in self.deltas if d.verdict == INSUFFICIENT)

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "threshold": self.threshold,
            "alpha": self.alpha,
            "deltas": [asdict(d) for d in self.deltas],
            "regressions": [d.name for d in self.regressions],
            "insufficient_runs": [d.name for d in self.insufficient],
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
        }


def run_samples(stats_json: Mapping[str, Any], metric: Metric) -> dict[str, list[float]]:
    """The per-iteration samples of ``metric`` per configuration from a stats document (docs/benchmark.md)."""
    if metric not in METRICS:
        raise StatisticsError(f"unknown comparison metric {metric!r}; choose one of {list(METRICS)}")
    try:
        raw = stats_json[metric]["raw_results"]
    except (KeyError, TypeError):
        raise StatisticsError(f"stats document has no per-iteration samples for metric {metric!r}") from None
    return {str(k): list(v) for k, v in raw.items()}


def compare_runs(
    a_stats_json: Mapping[str, Any],
    b_stats_json: Mapping[str, Any],
    threshold: float,
    alpha: float = ALPHA,
    metric: Metric = "makespan",
) -> RunComparison:
    """Compare run B against baseline run A per shared configuration, one sample per iteration.

    A regression is a B median slower than A's by more than ``threshold`` (relative, 0.10 = 10 %) *and*
    significant after Holm's correction across the shared configurations (adjusted p < ``alpha``); an
    improvement is the mirror image. Configurations present in only one run are listed, not compared.
    """
    if threshold <= 0:
        raise StatisticsError(f"regression threshold must be positive, got {threshold}")
    a_runs, b_runs = run_samples(a_stats_json, metric), run_samples(b_stats_json, metric)
    shared = sorted(a_runs.keys() & b_runs.keys())
    pairs = {n: (checked_samples(a_runs[n], f"A:{n}"), checked_samples(b_runs[n], f"B:{n}")) for n in shared}
    tests = tested_family(pairs, alpha)
    deltas = []
    for name, (a, b) in pairs.items():
        a_med, b_med = float(np.median(a)), float(np.median(b))
        if a_med <= 0:
            raise StatisticsError(f"configuration {name!r} has a non-positive baseline median ({a_med})")
        change = b_med / a_med - 1
        t = tests[name]
        verdict = (
            t.verdict
            if t.verdict == INSUFFICIENT
            else "regression"
            if change > threshold and t.verdict == SIGNIFICANT
            else "improvement"
            if change < -threshold and t.verdict == SIGNIFICANT
            else "same"
        )
        deltas.append(
            RunDelta(
                name=name,
                a_runs=int(a.size),
                b_runs=int(b.size),
                a_median=a_med,
                b_median=b_med,
                change_pct=change * 100,
                p_value=t.p_value,
                p_holm=t.p_holm,
                verdict=verdict,
            )
        )
    return RunComparison(
        metric=metric,
        threshold=threshold,
        alpha=alpha,
        deltas=tuple(deltas),
        only_in_a=tuple(sorted(a_runs.keys() - b_runs.keys())),
        only_in_b=tuple(sorted(b_runs.keys() - a_runs.keys())),
    )


# The run-to-run comparison as a table: `kbit compare` prints it, the nightly flow publishes it as an artifact.
COMPARISON_COLUMNS = ("configuration", "runs A/B", "A median s", "B median s", "change", "p Holm", "verdict")


def comparison_rows(deltas: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """One row of text per configuration (``RunDelta`` dicts, as ``RunComparison.to_dict`` gives them), under
    :data:`COMPARISON_COLUMNS`."""
    return [
        (
            d["name"],
            f"{d['a_runs']}/{d['b_runs']}",
            f"{d['a_median']:.4f}",
            f"{d['b_median']:.4f}",
            f"{d['change_pct']:+.1f}%",
            "–" if d["p_holm"] is None else f"{d['p_holm']:.3g}",
            d["verdict"],
        )
        for d in deltas
    ]


def regression_message(comparison: Mapping[str, Any], baseline: str) -> str | None:
    """One line naming every configuration whose verdict is a regression in ``comparison`` (as
    ``RunComparison.to_dict`` gives it) against ``baseline``; None when none regressed."""
    regressed = [d for d in comparison["deltas"] if d["verdict"] == "regression"]
    if not regressed:
        return None
    detail = ", ".join(f"{d['name']} {d['change_pct']:+.1f}% (Holm p={d['p_holm']:.3g})" for d in regressed)
    return (
        f"{len(regressed)} configuration(s) regressed against {baseline} beyond {comparison['threshold']:.0%}: {detail}"
    )


def regression_verdict(comparison: Mapping[str, Any], baseline: str) -> str:
    """A run-to-run comparison (``RunComparison.to_dict()``) in one sentence, regressions named."""
    deltas = comparison["deltas"]
    how = (
        f"against {baseline} (threshold {comparison['threshold']:.0%}, Mann–Whitney per iteration, "
        f"Holm-corrected, alpha {comparison['alpha']})"
    )
    regressed = [d for d in deltas if d["verdict"] == "regression"]
    if regressed:
        named = ", ".join(f"{d['name']} {d['change_pct']:+.1f}%" for d in regressed)
        return f"Regression: {len(regressed)} of {len(deltas)} configurations slower {how}: {named}."
    if all(d["verdict"] == INSUFFICIENT for d in deltas):
        return f"No verdict: too few iterations for a test {how}, in all {len(deltas)} configurations."
    counts = ", ".join(
        f"{n} {v}" for v in ("same", "improvement", INSUFFICIENT) if (n := sum(d["verdict"] == v for d in deltas))
    )
    return f"No regression {how}: {counts}."


def no_baseline_verdict(profile: str, experiment: str) -> str:
    """What a run without a comparable baseline says instead of a verdict."""
    return (
        f"No comparable baseline: no earlier finished {profile!r} benchmark in MLflow experiment {experiment!r} "
        "with this run's identity and without measurement overrides, so nothing was compared."
    )

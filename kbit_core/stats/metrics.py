"""The benchmark's metric names and how a statistics document lays out one configuration's numbers.

MLflow's compare view lines runs up by metric name, so these names never change between runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The median first: MLflow's compare view opens on a run's first logged metric.
STAT_METRICS = (
    "median",
    "count",
    "q1",
    "q3",
    "iqr",
    "lower_fence",
    "upper_fence",
    "lower_whisker",
    "upper_whisker",
    "mean",
    "variance",
    "std_dev",
    "min",
    "max",
    "olympic_mean",
    "median_ci_low",
    "median_ci_high",
)


def stat_metric_name(group: str, stat: str) -> str:
    """``makespan_median_s`` for the median, ``makespan_stats_<stat>_s`` for the rest (counts carry no unit, the
    variance is in s²): the headline number sorts first in MLflow's metric lists."""
    unit = "" if stat == "count" else "_s2" if stat == "variance" else "_s"
    return f"{group}_median_s" if stat == "median" else f"{group}_stats_{stat}{unit}"


def configuration_metrics(doc: Mapping[str, Any], name: str) -> dict[str, float]:
    """Every summary number of one configuration under its stable metric name."""
    out: dict[str, float] = {}
    for group, stats in (
        ("makespan", doc["makespan"]["statistical_analysis"][name]),
        ("rank_mean", doc["rank_mean"]["statistical_analysis"][name]),
        ("per_rank", doc["statistical_analysis"][name]),
    ):
        out.update({stat_metric_name(group, s): float(stats[s]) for s in STAT_METRICS})
        out[f"{group}_stats_outliers"] = float(len(stats["lower_outliers"]) + len(stats["upper_outliers"]))
    out.update({f"throughput_{k}": float(v) for k, v in doc["throughput"][name].items()})
    out.update({f"stage_{k.removesuffix('_s')}_median_s": float(v) for k, v in doc["stages"][name].items()})
    for view, comparison in doc["comparison"].items():
        entry = next(e for e in comparison["ranking"] if e["name"] == name)
        out[f"{view}_rank_by_median"] = float(entry["rank"])
        out[f"{view}_ratio_to_fastest"] = float(entry["ratio"])
        out[f"{view}_slowdown_pct"] = float(entry["slowdown_pct"])
        # The fastest (the reference) and too-few-runs entries have no p: no metric rather than NaN.
        if entry["p_holm"] is not None:
            out[f"{view}_p_holm"] = float(entry["p_holm"])
    for k, v in doc.get("training", {}).get(name, {}).items():
        out[f"train_{k}"] = float(v)
    # Skipped, padded, dropped: the most any rank had in one run, so MLflow shows every loss of data.
    out.update({f"max_{k}": float(v) for k, v in doc.get("counters", {}).get(name, {}).items()})
    return out


def verdict_against_fastest(entry: Mapping[str, Any]) -> str:
    """A ranking entry's answer in words, for the runs table: 'fastest', '2.31× slower (p=0.0002, Holm)', ..."""
    if entry["significance"] == "reference":
        return "fastest"
    if entry["significance"] == "insufficient runs":
        return f"{entry['ratio']:.2f}× the fastest, insufficient runs for a test"
    word = "slower" if entry["significance"] == "significant" else "the fastest, not significant"
    return f"{entry['ratio']:.2f}× {word} (p={entry['p_holm']:.2g}, Holm)"

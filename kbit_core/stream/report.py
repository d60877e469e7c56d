"""A continuous-training result in words: lag, freshness and throughput as markdown (the Prefect artifact, docs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_markdown(result: Mapping[str, Any]) -> str:
    """The headline (records, rate, freshness, lag, accuracy), lag warnings, then one row per report window."""
    fresh = result.get("freshness_s") or {}
    accuracy = result.get("test_accuracy")
    lines = [
        f"# Continuous training on `{result.get('topic', '?')}`",
        "",
        f"**{result['records_this_run']:,} records in {result['seconds']:.1f} s "
        f"({result['records_per_s']:,.0f} records/s) on {result['world_size']} rank(s); stopped: "
        f"{result['stop_reason'] or '-'}; test accuracy {'-' if accuracy is None else f'{accuracy:.4f}'}**",
        "",
        f"Freshness (produce time to the step that trained it): p50 {_seconds(fresh.get('p50'))} s, "
        f"p95 {_seconds(fresh.get('p95'))} s, p99 {_seconds(fresh.get('p99'))} s. Lag at the end: "
        f"{result.get('lag_records', '-')} records, {_seconds(result.get('lag_seconds'))} s behind the head. "
        f"Broker resets seen: {result.get('resets', 0)}.",
        "",
    ]
    lines += [f"> **warning:** {w}" for w in result.get("lag_warnings", [])[-3:]]
    lines += [
        "",
        "| step | records | records/s | freshness p50 s | p99 s | lag records | lag s | train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in result.get("history", []):
        lines.append(
            f"| {h['step']} | {h['records']:,} | {h['records_per_s']:,.0f} | "
            f"{_seconds(h['freshness_p50_s'])} | {_seconds(h['freshness_p99_s'])} | {h['lag_records']:,} | "
            f"{_seconds(h['lag_seconds'])} | {h['train_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"

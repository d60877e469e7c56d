"""The loading benchmark's plots from a stats document: box plots, mean ± std bars and stacked stages, each with
one row per configuration in the order given (bottom up)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kbit_core.bench.loading.measure import STAGES
from kbit_core.stats.samples import BoxStats


def _figure(num_configs: int, panels: int = 1):
    """A pyplot-free figure (no global state, safe off the main thread) sized for ``num_configs`` rows."""
    # matplotlib loads only when a plot is drawn (about a second to import)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7 * panels, 1.5 + 0.45 * num_configs), layout="constrained")
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def plot_boxplots(doc: Mapping[str, Any], names: list[str], path: Path) -> None:
    """Tukey box plots (whis=1.5), one row per name (bottom up): pooled per-rank load times (descriptive) and makespans."""
    fig, (pooled, span) = _figure(len(names), panels=2)
    for ax, raw, title in (
        (pooled, doc["raw_results"], "load time per rank"),
        (span, doc["makespan"]["raw_results"], "makespan per run (slowest rank)"),
    ):
        ax.boxplot([raw[n] for n in names], tick_labels=names, whis=1.5, orientation="horizontal")
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=120)


def plot_mean_std(doc: Mapping[str, Any], names: list[str], path: Path) -> None:
    """Mean ± sample standard deviation (ddof=1, as in the stats) of the per-rank load time."""
    stats = [BoxStats.from_dict(doc["statistical_analysis"][n]) for n in names]
    fig, (ax,) = _figure(len(names))
    y = np.arange(len(names))
    ax.barh(y, [s.mean for s in stats], xerr=[s.std_dev for s in stats], capsize=3, color="tab:blue", alpha=0.8)
    for yi, s in zip(y, stats):
        ax.annotate(f"{s.mean:.3f}", (s.mean, yi), xytext=(4, 4), textcoords="offset points", fontsize=8)
    ax.set_yticks(y, names)
    ax.set_xlabel("seconds (mean ± std, ddof=1)")
    ax.set_title("load time per rank (pooled, descriptive)")
    fig.savefig(path, dpi=120)


def plot_stages(doc: Mapping[str, Any], names: list[str], path: Path) -> None:
    """Median seconds per rank of every stage, stacked."""
    fig, (ax,) = _figure(len(names))
    y = np.arange(len(names))
    left = np.zeros(len(names))
    for stage in STAGES:
        widths = np.array([doc["stages"][n][f"{stage}_s"] for n in names])
        ax.barh(y, widths, left=left, label=stage)
        left += widths
    ax.set_yticks(y, names)
    ax.set_xlabel("median seconds per rank")
    ax.set_title("load time by stage")
    fig.legend(loc="outside lower center", ncols=len(STAGES))
    fig.savefig(path, dpi=120)

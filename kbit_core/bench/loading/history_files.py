"""The benchmark history's files: its plot (small multiples, one per configuration), markdown table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kbit_core.stats.history import History, history_markdown


def plot_history(history: History, path: Path, columns: int = 3) -> None:
    """Small multiples, one per configuration: nightly median makespan with its 95 % CI, change points marked."""
    # matplotlib loads only when a plot is drawn (about a second to import)
    from matplotlib.figure import Figure

    configs = history.configurations
    rows = max(1, -(-len(configs) // columns))
    fig = Figure(figsize=(5 * columns, 2.6 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, c in zip(axes, configs):
        medians, low, high = (np.asarray(v) for v in (c.medians, c.ci_low, c.ci_high))
        ax.errorbar(
            c.nights,
            medians,
            yerr=[medians - low, high - medians],
            fmt="o-",
            ms=3,
            capsize=2,
            color="tab:red" if c.unstable else "tab:blue",
        )
        for cp in c.change_points:
            ax.axvline(cp.night - 0.5, color="tab:orange", ls="--")
            ax.annotate(f"{cp.change_pct:+.0f}%", (cp.night - 0.5, float(high.max())), fontsize=8, color="tab:orange")
        ax.set_title(c.name + (" (unstable)" if c.unstable else ""), fontsize=9)
        ax.set_ylabel("makespan s")
        ax.set_xlabel("night (oldest first)")
        ax.grid(alpha=0.3)
    for ax in axes[len(configs) :]:
        ax.set_visible(False)
    fig.suptitle(history.verdict(), fontsize=9, wrap=True)
    fig.savefig(path, dpi=100)


HISTORY_FILES = {"plot": "history.png", "table": "history.md", "data": "history.json"}


def write_history(history: History, out_dir: Path) -> dict[str, Path]:
    """The plot, the markdown table and the JSON of ``history`` in ``out_dir``; returns them by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {kind: out_dir / name for kind, name in HISTORY_FILES.items()}
    plot_history(history, files["plot"])
    files["table"].write_text(f"# kbit benchmark history\n\n{history.verdict()}\n\n{history_markdown(history)}")
    files["data"].write_text(json.dumps(history.to_dict(), indent=2, allow_nan=False))
    return files

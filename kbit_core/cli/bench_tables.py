"""The benchmark's tables in the terminal: the results of one run, and run B against baseline A."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from kbit_core.bench.loading.report import RANKING_METRIC, significance_label
from kbit_core.stats.compare import COMPARISON_COLUMNS, comparison_rows

# Below this many columns the results table stacks its figures two to a cell instead of giving each a column.
WIDE_TABLE_COLUMNS = 130
_WIDE = (
    "#",
    "configuration",
    "runs",
    "makespan s [95% CI]",
    "ratio",
    "vs fastest (p Holm)",
    "per-rank median s",
    "records/s",
    "MB/s",
)
_NARROW = ("configuration", "makespan s\n[95% CI]", "× fastest\np (Holm)", "per-rank\nmedian s", "records/s\nMB/s")


def results_table(stats: dict[str, Any], width: int | None = None) -> Table:
    """Median makespan per iteration with its bootstrap CI and its Holm-corrected test against the fastest, the
    per-rank median and throughput, fastest first. Under ``width`` < WIDE_TABLE_COLUMNS (an 80-column terminal)
    two figures share a cell, so that none is cut off."""
    narrow = width is not None and width < WIDE_TABLE_COLUMNS
    table = Table(
        title=f"kbit benchmark {stats.get('metadata', {}).get('run_id', '')}".rstrip(),
        box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
        show_edge=not narrow,
        pad_edge=not narrow,
    )
    for column in _NARROW if narrow else _WIDE:
        table.add_column(
            column,
            justify="left" if column == "configuration" else "right",
            no_wrap=column != _NARROW[2] if narrow else column == "configuration",
        )
    for entry in stats["comparison"][RANKING_METRIC]["ranking"]:
        name = entry["name"]
        s, m, t = (
            stats["statistical_analysis"][name],
            stats["makespan"]["statistical_analysis"][name],
            stats["throughput"][name],
        )
        if narrow:
            table.add_row(
                f"{entry['rank']}. {name}\n   {entry['runs']} runs",
                f"{m['median']:.4f}\n[{m['median_ci_low']:.3f}, {m['median_ci_high']:.3f}]",
                f"{entry['ratio']:.2f}\n{significance_label(entry)}",
                f"{s['median']:.4f}",
                f"{t['records_per_s_median']:,.0f}\n{t['mb_per_s_median']:.2f}",
            )
            continue
        table.add_row(
            str(entry["rank"]),
            name,
            str(entry["runs"]),
            f"{m['median']:.4f} [{m['median_ci_low']:.4f}, {m['median_ci_high']:.4f}]",
            f"{entry['ratio']:.2f}",
            significance_label(entry),
            f"{s['median']:.4f}",
            f"{t['records_per_s_median']:,.0f}",
            f"{t['mb_per_s_median']:.2f}",
        )
    return table


def comparison_table(result: Any) -> Table:
    """Run B against baseline A, one row per configuration. Every figure and verdict keeps its whole text on any
    terminal (an 80-column one included): only the configuration's name folds onto more lines."""
    table = Table(
        title=f"B vs A ({result.metric} per iteration, threshold {result.threshold:.0%}, "
        f"alpha {result.alpha}, Holm-corrected)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for column in COMPARISON_COLUMNS:
        words = column in ("configuration", "verdict")  # may wrap between words; figures never do
        table.add_column(
            column.replace(" ", "\n", 1) if not words else column,
            justify="left" if words else "right",
            no_wrap=not words,
            overflow="fold",
        )
    for *cells, verdict in comparison_rows(result.to_dict()["deltas"]):
        table.add_row(
            *cells, {"regression": "[red]REGRESSION[/]", "improvement": "[green]improvement[/]"}.get(verdict, verdict)
        )
    return table

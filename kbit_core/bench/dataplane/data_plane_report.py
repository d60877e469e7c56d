"""The data-plane benchmark's results as tables: rich tables for the terminal, markdown for the docs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.table import Table

_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("dataset", "payload", str),
    ("variant", "variant", str),
    ("client", "client", str),
    ("records", "records", lambda v: f"{v:,}"),
    ("bytes_per_record", "B/rec", lambda v: f"{v:,.0f}"),
    ("produce_records_per_s", "produce rec/s", lambda v: f"{v:,.0f}"),
    ("fetch_records_per_s", "fetch rec/s", lambda v: f"{v:,.0f}"),
    ("fetch_mb_per_s", "fetch MB/s", lambda v: f"{v:,.1f}"),
    ("decode_records_per_s", "fast decode rec/s", lambda v: f"{v:,.0f}"),
    ("decode_mb_per_s", "decode MB/s", lambda v: f"{v:,.1f}"),
    ("decode_ratio", "decode/fetch", lambda v: f"{v:.2f}"),
    ("stock_decode_records_per_s", "stock decode rec/s", lambda v: f"{v:,.0f}"),
    ("stock_decode_ratio", "stock/fetch", lambda v: f"{v:.2f}"),
    ("speedup", "fast/stock", lambda v: f"{v:.1f}x"),
    ("decode_only_speedup", "decode step fast/stock", lambda v: f"{v:.1f}x"),
    ("loader_records_per_s", "loader rec/s", lambda v: f"{v:,.0f}"),
    ("loader_ratio", "loader/fetch", lambda v: f"{v:.2f}"),
    ("loader_ratio_spread", "spread", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    ("loader_large_batch_ratio", "loader/fetch batch 512", lambda v: f"{v:.2f}"),
    ("loader_large_batch_ratio_spread", "spread 512", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    ("connect_ms", "connect ms", lambda v: f"{v:.1f}"),
]


def results_table(results: dict[str, Any]) -> Table:
    processes = results["meta"].get("decode_processes", 0)
    pool = f"; fast decode and loader with {processes} decode process(es) beside the thread" if processes else ""
    table = Table(title=f"data plane: read+decode against the raw fetch of the same topic (one rank{pool})")
    for _, header, _ in _COLUMNS:
        table.add_column(header, justify="left" if header in ("payload", "variant", "client") else "right")
    for row in results["rows"]:
        table.add_row(*(fmt(row[key]) for key, _, fmt in _COLUMNS))
    for entry in results.get("left_out", []):
        table.add_row(entry["dataset"], entry["variant"], f"left out: {entry['reason']}")
    return table


# The loader per reader.workers (DataPlaneRow.loader_by_workers): loader ÷ fetch and ÷ read+decode at both batches.
_WORKER_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("records_per_s", "loader rec/s", lambda v: f"{v:,.0f}"),
    ("ratio", "loader/fetch", lambda v: f"{v:.2f}"),
    ("spread", "spread", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    ("decode_ratio", "loader/decode", lambda v: f"{v:.2f}"),
    ("large_batch_records_per_s", "loader rec/s batch 512", lambda v: f"{v:,.0f}"),
    ("large_batch_ratio", "loader/fetch batch 512", lambda v: f"{v:.2f}"),
    ("large_batch_spread", "spread 512", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
    ("large_batch_decode_ratio", "loader/decode batch 512", lambda v: f"{v:.2f}"),
]


def _worker_rows(results: dict[str, Any]) -> list[list[str]]:
    return [
        [
            row["dataset"],
            row["variant"],
            row["client"],
            workers,
            *(fmt(figures[key]) for key, _, fmt in _WORKER_COLUMNS),
        ]
        for row in results["rows"]
        for workers, figures in row.get("loader_by_workers", {}).items()
    ]


def loader_workers_table(results: dict[str, Any]) -> Table:
    """The loader with each ``reader.workers`` measured, against the same run's fetch and read+decode."""
    table = Table(title="loader per reader.workers: against the fetch and the read+decode of the same run")
    for header in ("payload", "variant", "client", "workers", *(h for _, h, _ in _WORKER_COLUMNS)):
        table.add_column(header, justify="left" if header in ("payload", "variant", "client", "workers") else "right")
    for cells in _worker_rows(results):
        table.add_row(*cells)
    return table


def targets_table(results: dict[str, Any]) -> Table:
    table = Table(title="targets")
    for col in ("target", "measured", "met"):
        table.add_column(col)
    for t in results["targets"]:
        table.add_row(t["target"], f"{t['value']:,}", "[green]yes[/]" if t["met"] else "[red]no[/]")
    return table


def run_line(meta: dict[str, Any]) -> str:
    """When, against which broker, with which client and at what load the run measured (older results: what they
    recorded)."""
    clients = " / ".join(f"{name} {v}" for name, v in meta.get("clients", {}).items()) or "client versions unrecorded"
    start, end = meta.get("load_average_1m_at_start"), meta.get("load_average_1m_at_end")
    load = f"1-minute load average {start} at the start, {end} at the end" if start is not None else "load unrecorded"
    return f"{meta['created_at'][:16].replace('T', ' ')} UTC; {meta['broker']}; {clients}; {meta['cpus']} CPUs; {load}"


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (rows, RSS runs, targets), under the run's line (:func:`run_line`)."""
    lines = [run_line(results["meta"]), ""]
    lines += ["| " + " | ".join(h for _, h, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(fmt(row[key]) for key, _, fmt in _COLUMNS) + " |" for row in results["rows"]]
    if results.get("left_out"):
        lines += ["", "| payload | variant left out | why |", "|---|---|---|"]
        lines += [f"| {e['dataset']} | {e['variant']} | {e['reason']} |" for e in results["left_out"]]
    if results["rss"]:
        lines += ["", "| stream RSS: records | peak RSS MB | RSS after first batch MB | seconds |", "|---|---|---|---|"]
        lines += [
            f"| {r['records']:,} | {r['peak_rss_mb']:.1f} | {r['rss_after_first_batch_mb']:.1f} | {r['seconds']:.1f} |"
            for r in results["rss"]["runs"]
        ]
    headers = ["payload", "variant", "client", "workers", *(h for _, h, _ in _WORKER_COLUMNS)]
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cells) + " |" for cells in _worker_rows(results)]
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']:,} | {'yes' if t['met'] else 'no'} |" for t in results["targets"]]
    return "\n".join(lines) + "\n"

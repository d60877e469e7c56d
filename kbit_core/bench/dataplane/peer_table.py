"""A peer reader's records/s beside kbit's on the same topics, with kbit's lead over it, as one terminal table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rich.table import Table

# (reader, records/s, kbit ÷ this per kbit client, records the reader left out) for each of a comparison's peer rows
PeerRows = Callable[[dict[str, Any]], Iterable[tuple[str, float, str, int]]]


def ratios_text(ratios: Iterable[float]) -> str:
    """kbit's lead per kbit client, e.g. '3.10x / 2.95x'."""
    return " / ".join(f"{r:.2f}x" for r in ratios)


def peer_table(title: str, comparisons: list[dict[str, Any]], peer_rows: PeerRows) -> Table:
    """kbit's read+decode records/s per client, then the peer's rows, per variant."""
    table = Table(title=title)
    for column in ("variant", "reader", "records/s", "kbit ÷ this (per kbit client)", "records left out"):
        table.add_column(column, justify="left" if column in ("variant", "reader") else "right")
    for comparison in comparisons:
        for client, rate in comparison["kbit_records_per_s"].items():
            table.add_row(comparison["variant"], f"kbit, {client}", f"{rate:,.0f}", "-", "0")
        for reader, rate, ratios, missing in peer_rows(comparison):
            table.add_row(comparison["variant"], reader, f"{rate:,.0f}", ratios, f"{missing:,}")
    return table

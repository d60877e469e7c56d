"""`kbit train`'s tables: scalars in one, the per-split data counts in their own."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kbit_core.cli.train import data_table, metrics_table


def render(table: Table) -> str:
    console = Console(record=True, width=250)
    console.print(table)
    return console.export_text()


def test_data_counts_get_one_row_per_split_and_stay_out_of_the_metrics_table() -> None:
    data = {
        "train": {"skipped_messages": 0, "padded_records": 0, "dropped_tail_records_per_epoch": 16},
        "val": {"skipped_messages": 1, "padded_records": 1, "dropped_tail_records_per_epoch": 0},
    }
    rows = [line.split("│")[1:-1] for line in render(data_table(data)).splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [["train", "0", "0", "16"], ["val", "1", "1", "0"]]
    assert "skipped messages" in render(data_table(data))
    assert "skipped" not in render(metrics_table({"test_accuracy": 0.9, "data": data}))

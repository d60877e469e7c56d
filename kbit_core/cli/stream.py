"""`kbit produce --stream` output: run the live producer and print what it appended (the flag lives on `produce`)."""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from kbit_core.cli.common import print_json, run_guarded
from kbit_core.config import KbitConfig

out = Console()


def produce_stream(cfg: KbitConfig, as_json: bool) -> None:
    """Append to the stream topic at ``stream.rate`` until ``stream.duration_s`` / ``stream.records`` / Ctrl-C."""
    from kbit_core.stream.live_producer import LiveProducer

    run = run_guarded(lambda: LiveProducer(cfg).run())
    summary = {**asdict(run), "achieved_rate": run.achieved_rate}
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"stream {run.topic}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:,.1f}" if isinstance(value, float) else str(value))
    out.print(table)

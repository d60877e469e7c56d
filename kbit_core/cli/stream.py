"""`kbit produce --stream` (the flag lives on `produce`; this prints what the live producer appended) and
`kbit bench-stream`; the live producer and the stream benchmark are imported by the commands that run them (the
CLI's import budget, tests/unit/test_cli_imports.py)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kbit_core.cli.common import ConfigOpt, JsonOpt, SetOpt, load_cli_config, print_json, print_results, run_guarded
from kbit_core.config import DataVariant, KbitConfig

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


def bench_stream_command(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    variant_specs: Annotated[
        list[str] | None,
        typer.Option(
            "--variant",
            help="format:layout:compression, repeatable (default: raw:bytes:lz4, avro:list:lz4, json:list:lz4).",
        ),
    ] = None,
    rates: Annotated[str, typer.Option(help="Comma-separated produce rates to climb, records/s.")] = "200,400,800,1600",
    fixed_rate: Annotated[float, typer.Option(help="Rate of the first stage, where freshness is measured.")] = 100,
    warmup_s: Annotated[float, typer.Option(help="Length of the fixed-rate stage (it absorbs the start-up).")] = 60,
    stage_s: Annotated[float, typer.Option(help="Length of every other stage.")] = 20,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSON results file.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Per format: the highest produce rate continuous training sustains with bounded lag, and its freshness."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.jobs.stream_bench import results_table, run_stream_bench

    chosen = variant_specs or ["raw:bytes:lz4", "avro:list:lz4", "json:list:lz4"]
    variants = run_guarded(
        lambda: [DataVariant(**dict(zip(("format", "layout", "compression"), v.split(":")))) for v in chosen]
    )
    print_results(
        lambda: run_stream_bench(
            cfg,
            variants,
            [float(r) for r in rates.split(",")],
            fixed_rate=fixed_rate,
            warmup_s=warmup_s,
            stage_s=stage_s,
            output=output,
        ),
        results_table,
        as_json,
    )


def register(app: typer.Typer) -> None:
    """Add `kbit bench-stream` to the root app (`kbit produce --stream` is a flag of `produce`)."""
    app.command("bench-stream")(bench_stream_command)

"""`kbit train` (one distributed training job from a profile) and the training benchmarks `kbit bench-train` and
`kbit bench-placement`.

The jobs and benchmarks (torch, Spark, Ray and MLflow behind them) are imported inside the commands that run them,
so `kbit --help` and a config error answer at once (tests/unit/test_cli_imports.py)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kbit_core.cli.common import (
    TRAINING_STOPPED,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    load_cli_config,
    print_json,
    print_results,
    run_guarded,
)
from kbit_core.config import KbitConfig

out = Console()

# Per-step and per-epoch series are long; the table keeps the scalars and the JSON output keeps everything.
# The per-split data counts get a table of their own.
_NOT_SCALAR = ("loss_curve", "history", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "data")


def metrics_table(result: dict[str, Any]) -> Table:
    table = Table(title="training result", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key in _NOT_SCALAR:
            continue
        table.add_row(key, _format(value))
    if result.get("val_accuracy"):
        table.add_row("val_accuracy per epoch", " ".join(f"{v:.4f}" for v in result["val_accuracy"]))
    return table


def data_table(data: dict[str, dict[str, int]]) -> Table:
    """One row per split: messages skipped as corrupt, records repeated in their place, offset gaps and retries
    (summed over ranks and epochs), and what the shard plan drops or pads every epoch."""
    table = Table(title="data read")
    table.add_column("split", style="bold")
    columns = list(dict.fromkeys(key for counts in data.values() for key in counts))
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for split, counts in data.items():
        table.add_row(split, *(_format(counts.get(column)) for column in columns))
    return table


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4f}" if abs(value) < 1000 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return escape(str(value))  # e.g. a tracking error quoting a path: text, not Rich markup


def train_command(config: ConfigOpt = None, sets: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Train once: produce or reuse the topic, launch DDP/DeepSpeed through TorchDistributor, print final metrics."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.jobs.train import train  # after the config: a config error answers before torch is imported

    # TorchDistributor copies the workers' output to stdout; with --json, stdout carries the JSON alone.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = run_guarded(train, cfg, progress=not as_json, on_interrupt=TRAINING_STOPPED)
    if as_json:
        print_json(result)
    else:
        out.print(metrics_table(result))
        if result.get("data"):
            out.print(data_table(result["data"]))


OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="JSON results file.")]


def bench_train_command(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    output: OutputOpt = None,
    repeats: Annotated[int, typer.Option(min=1, help="Launches per measured mode.")] = 1,
    variants: Annotated[
        list[str] | None,
        typer.Option(
            "--variants",
            "-v",
            help="Also stream these variants (format_layout_compression[_xN][_confluent]), repeatable.",
        ),
    ] = None,
    fast_consumer: Annotated[
        float | None,
        typer.Option(
            "--fast-consumer",
            min=0,
            metavar="MS",
            help="Only the loader's ceiling: streamed vs in-memory with each training step replaced by a busy wait of "
            "MS ms holding the interpreter lock (0: none), standing in for a fast GPU step.",
        ),
    ] = None,
    direct: Annotated[
        bool,
        typer.Option(
            "--direct",
            help="Only training straight from the dataset (train.data: direct) vs the same dataset streamed from Kafka "
            "and read from Kafka into memory first.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Kafka-streamed vs in-memory training throughput, launch overheads, and DeepSpeed vs DDP step time."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.bench.dataplane.data_plane import parse_variant
    from kbit_core.bench.training.direct_bench import direct_table, run_direct_bench
    from kbit_core.bench.training.fast_consumer_bench import fast_consumer_table, run_fast_consumer_bench
    from kbit_core.bench.training.train_bench import results_table, run_train_bench

    if direct:
        _run_bench(run_direct_bench, direct_table, cfg, output, repeats, as_json)
        return
    chosen = [run_guarded(parse_variant, v) for v in variants or ()]
    if fast_consumer is not None:
        run = functools.partial(run_fast_consumer_bench, step_ms=fast_consumer, variants=chosen)
        _run_bench(run, fast_consumer_table, cfg, output, repeats, as_json)
        return
    _run_bench(functools.partial(run_train_bench, variants=chosen), results_table, cfg, output, repeats, as_json)


def bench_placement_command(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    output: OutputOpt = None,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds of both placements.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """A cluster launch (e.g. deployments/train-cluster.yaml on the test bed) vs the same training on this host alone."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.bench.training.placement_bench import placement_table, run_placement_bench

    _run_bench(run_placement_bench, placement_table, cfg, output, repeats, as_json)


def _run_bench(
    run: Callable[..., dict[str, Any]],
    table: Callable[[dict[str, Any]], Table],
    cfg: KbitConfig,
    output: Path | None,
    repeats: int,
    as_json: bool,
) -> None:
    print_results(lambda: run(cfg, output=output, repeats=repeats), table, as_json)


def register(app: typer.Typer) -> None:
    """Add `kbit train`, `kbit bench-train` and `kbit bench-placement` to the root app."""
    app.command("train")(train_command)
    app.command("bench-train")(bench_train_command)
    app.command("bench-placement")(bench_placement_command)

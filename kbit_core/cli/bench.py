"""`kbit bench`, `kbit report`, `kbit compare` and `kbit history`: run the benchmark, rebuild its report, flag
regressions, and follow each configuration over the nights.

The benchmark, its statistics and MLflow (torch, scipy and pandas behind them) are imported inside the commands that
use them, so `kbit --help` and a config error answer at once (tests/unit/test_cli_imports.py)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kbit_core.cli.common import (
    BENCH_STOPPED,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    console,
    load_cli_config,
    print_json,
    run_guarded,
)
from kbit_core.config import BenchConfig, load_config, parse_overrides


def bench(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Benchmark loading every configured variant from Kafka across ranks (warm-up + N iterations).

    A run with --set overrides that change what is measured never becomes a nightly baseline."""
    overrides = run_guarded(parse_overrides, sets or [])  # parsed once: the config and the run's tag both read it
    cfg = run_guarded(load_config, config, overrides)
    from kbit_core.cli.bench_tables import results_table
    from kbit_core.jobs.benchmark import run_benchmark
    from kbit_core.tracking import record_overrides

    # With --json, stdout carries exactly one JSON document: worker output goes to stderr.
    redirect = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with redirect:
        result = run_guarded(run_benchmark, cfg, progress=not quiet, on_interrupt=BENCH_STOPPED)
        run_guarded(record_overrides, cfg, result.parent_run_id, overrides)
    if as_json:
        print_json(result.to_dict())
        return
    terminal = Console()
    terminal.print(results_table(result.stats, terminal.width))
    console.print(
        f"report: {result.report_dir}" + (f"  mlflow run: {result.parent_run_id}" if result.parent_run_id else "")
    )


def report(
    run_dir: Annotated[Path, typer.Argument(help="A benchmark report directory (holds raw_timings.csv).")],
    as_json: JsonOpt = False,
) -> None:
    """Rebuild every report file of RUN_DIR from its raw timings CSV."""
    from kbit_core.bench.loading.report import load_stats, rebuild_report
    from kbit_core.cli.bench_tables import results_table

    files = run_guarded(rebuild_report, run_dir)
    stats = load_stats(files.stats_json)
    if as_json:
        print_json({"files": files.to_dict(), "comparison": stats["comparison"]})
        return
    terminal = Console()
    terminal.print(results_table(stats, terminal.width))
    console.print(f"rebuilt {len(files.paths())} files in {run_dir}")


def compare(
    a: Annotated[Path, typer.Argument(help="Baseline: report directory or its stats.json.")],
    b: Annotated[Path, typer.Argument(help="Candidate: report directory or its stats.json.")],
    threshold: Annotated[
        float | None,
        typer.Option(help="Relative median slowdown that counts as a regression (default bench.regression_threshold)."),
    ] = None,
    alpha: Annotated[float, typer.Option(help="Family-wise significance level (Mann–Whitney U, Holm).")] = 0.05,
    metric: Annotated[
        str, typer.Option(help="Per-iteration unit: 'makespan' (slowest rank) or 'rank_mean'.")
    ] = "makespan",
    force: Annotated[bool, typer.Option("--force", help="Compare runs of different identities anyway.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compare run B against baseline A; exit code 1 when any configuration regressed.

    Runs of different identities (profile, dataset, variants, iterations, world size, engine, clients,
    broker, hardware) are refused with their differences named, unless --force."""
    from kbit_core.bench.loading.report import load_stats
    from kbit_core.cli.bench_tables import comparison_table
    from kbit_core.stats.compare import compare_runs
    from kbit_core.stats.identity import check_comparable, comparability_problems

    limit = threshold if threshold is not None else BenchConfig().regression_threshold
    a_stats, b_stats = run_guarded(load_stats, a), run_guarded(load_stats, b)
    if not force:
        run_guarded(check_comparable, a_stats, b_stats)
    for problem in comparability_problems(a_stats, b_stats):
        console.print(f"[yellow]compared anyway (--force):[/] {escape(problem)}", highlight=False)
    result = run_guarded(compare_runs, a_stats, b_stats, limit, alpha, metric)
    if as_json:
        print_json(result.to_dict())
    else:
        Console().print(comparison_table(result))
        for side, names in (("A", result.only_in_a), ("B", result.only_in_b)):
            if names:
                console.print(f"only in {side}: {', '.join(names)}")
        if result.insufficient:
            console.print(f"insufficient runs for a verdict: {', '.join(d.name for d in result.insufficient)}")
        console.print(f"{len(result.regressions)} regression(s)")
    if result.regressions:
        raise typer.Exit(code=1)


def history(
    profile: Annotated[
        str | None,
        typer.Option(
            help="Benchmark profile whose runs to read (experiment kbit-<profile>); default: the config's, "
            "or nightly without --config."
        ),
    ] = None,
    last: Annotated[int | None, typer.Option(min=1, help="Only the newest N nights.")] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(envvar="MLFLOW_TRACKING_URI", help="MLflow store (default: the config's, sqlite in its workdir)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Where history.png/.md/.json go (default: <bench.output_dir>/history).")
    ] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Each configuration's nightly median makespan with its CI, change points (with the commits between)
    and unstable configurations, over the finished override-free runs of the newest run's identity."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.jobs.history import history_report
    from kbit_core.stats.history import history_markdown

    chosen = {"profile": profile or (cfg.profile if config else "nightly")}
    if tracking_uri:
        chosen["tracking.tracking_uri"] = tracking_uri
    cfg = run_guarded(cfg.override, chosen)
    found, files, left_out = run_guarded(history_report, cfg, out or Path(cfg.bench.output_dir) / "history", last)
    if as_json:
        print_json({**found.to_dict(), "files": {k: str(v) for k, v in files.items()}, "left_out": left_out})
        return
    console.print(found.verdict(), highlight=False)
    Console().print(history_markdown(found), markup=False, highlight=False)
    for reason in left_out:
        console.print(f"left out: {reason}", highlight=False)
    console.print(f"plot: {files['plot']}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command()(bench)
    app.command()(report)
    app.command()(compare)
    app.command()(history)

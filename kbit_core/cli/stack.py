"""`kbit stack up | down | status`: the local broker, Prefect server + worker, MLflow server and a Ray head."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kbit_core.cli.common import ConfigOpt, JsonOpt, SetOpt, load_cli_config, print_json, run_guarded
from kbit_core.stack import LocalStack, ServiceStatus, schedule_lines

stack_app = typer.Typer(help="Start, stop and inspect the local stack (broker, Prefect, MLflow).", no_args_is_help=True)
out = Console()


def _table(services: list[ServiceStatus]) -> Table:
    table = Table(title="kbit stack")
    # URLs and paths are copied from here: never elide them; a URL stays on one line (a link to click), the log
    # path folds when the terminal is narrow.
    for col in ("service", "state", "pid"):
        table.add_column(col, no_wrap=True)
    table.add_column("url", no_wrap=True, min_width=max((len(s.url or "-") for s in services), default=3))
    table.add_column("log", overflow="fold")
    for s in services:
        state = "[green]running[/]" if s.running else "[red]stopped[/]"
        table.add_row(s.name, state, str(s.pid or "-"), s.url or "-", str(s.log_path or "-"))
    return table


def _report(services: list[ServiceStatus], as_json: bool) -> None:
    if as_json:
        print_json(
            [
                {
                    "name": s.name,
                    "running": s.running,
                    "pid": s.pid,
                    "url": s.url,
                    "log": str(s.log_path) if s.log_path else None,
                }
                for s in services
            ]
        )
    else:
        out.print(_table(services))


@stack_app.command("up")
def up(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    broker_only: Annotated[bool, typer.Option("--broker-only", help="Start only the embedded broker.")] = False,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray", help="Also start a local Ray head on 127.0.0.1 (launch.ray_head_port) for launch.engine=ray."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Start the broker, Prefect server, MLflow server (and with --ray a Ray head); deploy, start the worker."""
    cfg = run_guarded(load_cli_config, config, sets)
    stack = LocalStack(cfg)
    with out.status("starting the kbit stack (Prefect and MLflow take ~10 s each)..."):
        services = run_guarded(stack.up, broker_only=broker_only, ray=ray)
    _report(services, as_json)
    if not broker_only and not as_json:
        out.print(f"Prefect UI: {stack.prefect_ui_url}    MLflow UI: {stack.mlflow_url}")
        for line in schedule_lines(run_guarded(stack.deployments)):
            out.print(line, highlight=False)


@stack_app.command("down")
def down(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Stop every service this run directory started (by PID)."""
    cfg = run_guarded(load_cli_config, config, sets)
    stopped = run_guarded(LocalStack(cfg).down)
    out.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@stack_app.command("status")
def status(config: ConfigOpt = None, sets: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Show each service with its PID, URL and log; exit code 1 when any is down."""
    cfg = run_guarded(load_cli_config, config, sets)
    services = run_guarded(LocalStack(cfg).status)
    _report(services, as_json)
    if not all(s.running for s in services):
        raise typer.Exit(code=1)


@stack_app.command("env")
def env(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Print `export` lines that point the prefect and mlflow CLIs at this stack: eval "$(kbit stack env)". With
    ``stack.auth`` they log in too, reading the password from its file (never printed)."""
    for key, value in LocalStack(run_guarded(load_cli_config, config, sets)).shell_env().items():
        print(f"export {key}={value}")


def register(app: typer.Typer) -> None:
    """Add the `stack` command group to the root app."""
    app.add_typer(stack_app, name="stack")

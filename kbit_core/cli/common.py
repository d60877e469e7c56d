"""Options and helpers shared by every `kbit` command: config loading, clear errors, JSON output."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kbit_core.config import KbitConfig, load_config
from kbit_core.errors import KbitError

console = Console(stderr=True, soft_wrap=True)  # soft wrap: an error message stays one greppable line

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML profile (see deployments/).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override, e.g. train.epochs=3 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def load_cli_config(config: Path | None, sets: list[str] | None) -> KbitConfig:
    return load_config(config, sets or [])


DebugOpt = Annotated[
    bool,
    typer.Option("--debug", envvar="KBIT_DEBUG", help="Print the full traceback of an error, not just its message."),
]

# Exit code of a run ended by SIGINT or SIGTERM, as shells report a process killed by SIGINT (128 + 2).
INTERRUPTED_EXIT = 130

_debug = False


def set_debug(enabled: bool) -> None:
    """Whether errors print their traceback (the root ``--debug`` flag)."""
    global _debug
    _debug = enabled
    # The launcher shows the ranks' tracebacks as they come only then (kbit_core.launch.distributor.DEBUG_ENV).
    if enabled:
        os.environ["KBIT_DEBUG"] = "1"
    else:
        os.environ.pop("KBIT_DEBUG", None)


def debug_enabled() -> bool:
    return _debug


def fail(exc: BaseException) -> typer.Exit:
    """Print an error as one plain-text message and return the exit to raise.

    Error texts quote user input and library messages (gloo's ``[/path/pair.cc:553]``), so they are escaped,
    never read as Rich markup. A kbit error is expected and prints its message alone; anything else also
    names its type. ``--debug`` adds the traceback.
    """
    message = str(exc) if isinstance(exc, KbitError) else f"{type(exc).__name__}: {exc}"
    if _debug:
        console.print(escape("".join(traceback.format_exception(exc))), end="", highlight=False)
        if isinstance(exc, KbitError) and exc.details:
            console.print(escape(exc.details), highlight=False)
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    if not _debug and not isinstance(exc, KbitError):
        console.print("(run with --debug for the traceback)", highlight=False)
    return typer.Exit(code=1)


# What an interrupted command says it did and what to do next (run_guarded's ``on_interrupt``).
STOPPED = "stopped and cleaned up"
TRAINING_STOPPED = (
    "stopped the workers and cleaned up; with checkpoint.dir set, rerun with --set checkpoint.resume=latest to continue"
)
PRODUCE_STOPPED = (
    "stopped producing; the partly written topic is deleted (or, if the broker cannot be reached, by the next "
    "produce), so rerunning the same command produces it afresh"
)
BENCH_STOPPED = (
    "stopped the benchmark and its workers and cleaned up; an interrupted benchmark reports nothing, so rerun it "
    "(topics already produced are reused)"
)


def run_guarded(fn, *args: Any, on_interrupt: str = STOPPED, **kwargs: Any) -> Any:
    """Call ``fn``; an error becomes a red message and exit code 1, an interrupt (Ctrl-C, SIGTERM) exit code 130
    with ``on_interrupt``: what was stopped and how to go on, which differs by command.

    The interrupt is raised inside ``fn`` as KeyboardInterrupt, so its context managers (broker, Spark run,
    MLflow run) have already cleaned up when it arrives here.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        console.print(f"[bold red]interrupted:[/] {on_interrupt}", highlight=False)
        raise typer.Exit(code=INTERRUPTED_EXIT) from None
    except Exception as exc:
        raise fail(exc) from None


def terminate_like_interrupt() -> None:
    """Make SIGTERM (sent by `timeout`, systemd, container stops, Prefect cancellation) end the run as Ctrl-C does.

    The handler calls whatever SIGINT handler is installed when the signal arrives: Python's default raises
    KeyboardInterrupt, and a live SparkContext's own handler first cancels its jobs (which stops the workers
    that, unlike with Ctrl-C in a terminal, got no signal themselves) and then raises it.
    """

    def on_sigterm(signum: int, frame: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        # A handler that only records the interrupt (some libraries install one) must not swallow a SIGTERM.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_results(compute: Callable[[], dict[str, Any]], table: Callable[[dict[str, Any]], Any], as_json: bool) -> None:
    """Run ``compute`` (guarded) and print its results: one JSON document with ``--json``, else ``table(results)``.

    Under ``--json`` whatever the run prints (TorchDistributor copies the workers' output) goes to stderr, so stdout
    carries the JSON alone.
    """
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        results = run_guarded(compute)
    if as_json:
        print_json(results)
    else:
        Console().print(table(results))

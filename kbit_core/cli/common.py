"""Options and helpers shared by every `kbit` command: config loading, clear errors, JSON output."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from kbit_core.config import KbitConfig, load_config
from kbit_core.errors import KbitError

console = Console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML profile (see deployments/).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override, e.g. train.epochs=3 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def load_cli_config(config: Path | None, sets: list[str] | None) -> KbitConfig:
    return load_config(config, sets or [])


def fail(exc: BaseException) -> typer.Exit:
    """Print a kbit error as one clear message (no traceback) and return the exit to raise."""
    console.print(f"[bold red]error:[/] {exc}")
    return typer.Exit(code=1)


def run_guarded(fn, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; KbitError becomes a red one-line message and exit code 1."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return fn(*args, **kwargs)
    except KbitError as exc:
        raise fail(exc) from None


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()

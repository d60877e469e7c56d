"""The `kbit` command line: one typer app whose command groups live in sibling modules."""

from __future__ import annotations

import typer

from kbit_core.cli import bench, data, stack, train

app = typer.Typer(
    name="kbit",
    help="Serialize datasets into Kafka, stream them into distributed PyTorch training, and benchmark it.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

for module in (stack, data, train, bench):
    module.register(app)


def main() -> None:
    app()

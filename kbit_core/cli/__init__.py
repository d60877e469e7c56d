"""The `kbit` command line: one typer app whose command groups live in sibling modules."""

from __future__ import annotations

from importlib.metadata import version as dist_version

import typer

from kbit_core.cli import bench, cluster, data, dataplane, stack, stream, train
from kbit_core.cli.common import DebugOpt, debug_enabled, fail, set_debug, terminate_like_interrupt

app = typer.Typer(
    name="kbit",
    help="Serialize datasets into Kafka, stream them into distributed PyTorch training, and benchmark it.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root(debug: DebugOpt = False) -> None:
    """kbit: Kafka-streamed distributed training and its benchmark."""
    set_debug(debug)


for module in (stack, cluster, data, dataplane, train, bench, stream):
    module.register(app)


@app.command()
def version() -> None:
    """Print the kbit version and the versions of the components it drives."""
    for dist in ("kbit", "torch", "pyspark", "deepspeed", "confluent-kafka", "kafka-python", "prefect", "mlflow"):
        try:
            print(f"{dist:16} {dist_version(dist)}")
        except Exception:
            print(f"{dist:16} not installed")


def main() -> None:
    terminate_like_interrupt()
    try:
        app()
    except Exception as exc:  # raised outside run_guarded, by the CLI layer itself: still one line, unless --debug
        if debug_enabled():
            raise
        raise SystemExit(fail(exc).exit_code) from None

"""`kbit bench-data`: produce, fetch and decode throughput per variant × client, and streaming memory.

The benchmark and its peers (torch, Ray and Spark behind them) are imported once the config has loaded, so `kbit
--help` and a config error answer at once (tests/unit/test_cli_imports.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, get_args

import typer
from pydantic import ValidationError
from rich.console import Console

from kbit_core.cli.common import ConfigOpt, JsonOpt, SetOpt, load_cli_config, print_json, run_guarded
from kbit_core.config import DatasetConfig, KbitConfig, ReaderConfig
from kbit_core.errors import ConfigError

# wide tables: when piped (no terminal width), do not squeeze a dozen numeric columns into 80 characters
out = Console(width=None if sys.stdout.isatty() else 220)


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if len(sizes) != 2 or sizes[0] >= sizes[1] or sizes[0] < 1:
        raise typer.BadParameter("give two increasing record counts, e.g. 60000,600000")
    return sizes


# The peers a run can be compared with, in the order of their options.
PEER_NAMES = ("kafka_tools", "ray_read_kafka", "spark_kafka_source")


def _peers() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """Each peer's comparison and its terminal table, by name."""
    from kbit_core.bench.dataplane import kafka_tools, ray_data_peer, spark_kafka_peer

    return {
        "kafka_tools": (kafka_tools.compare, kafka_tools.tools_table),
        "ray_read_kafka": (ray_data_peer.compare, ray_data_peer.peer_table),
        "spark_kafka_source": (spark_kafka_peer.compare, spark_kafka_peer.peer_table),
    }


DatasetsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--datasets",
        help="Payloads, repeatable, e.g. synthetic_digits and synthetic_tokens: the dataset section under each "
        "name (default: bench.datasets, else dataset).",
    ),
]
RayPeerOpt = Annotated[
    bool,
    typer.Option("--ray-peer", help="Also read each topic with ray.data.read_kafka (the `ray` extra) and compare."),
]
SparkPeerOpt = Annotated[
    bool,
    typer.Option("--spark-peer", help="Also read each topic with Spark's Kafka source (spark.read.format('kafka'))."),
]
KafkaToolsOpt = Annotated[
    bool,
    typer.Option(
        "--kafka-tools",
        help="Also run Apache Kafka's ConsumerPerformance and ProducerPerformance on each topic and compare.",
    ),
]


VariantsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--variants", "-v", help="format_layout_compression[_xN][_confluent], repeatable (default: bench.variants)."
    ),
]
ClientsOpt = Annotated[
    list[str] | None, typer.Option("--clients", help="confluent | kafka-python, repeatable (default: bench.clients).")
]
RssRecordsOpt = Annotated[str, typer.Option("--rss-records", help="Small,large topic sizes for the RSS check.")]
LoaderWorkersOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--loader-workers",
        help="Also time the loader with this reader.workers (thread | process | partitions), repeatable.",
    ),
]


def bench_data(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    records: Annotated[int | None, typer.Option("--records", "-n", help="Records per topic.")] = None,
    variants: VariantsOpt = None,
    clients: ClientsOpt = None,
    datasets: DatasetsOpt = None,
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Timed reads per cell (median).")] = 3,
    rss: Annotated[bool, typer.Option("--rss/--no-rss", help="Measure streaming peak RSS on two topic sizes.")] = True,
    rss_records: RssRecordsOpt = "60000,600000",
    keep_topics: Annotated[bool, typer.Option("--keep-topics", help="Keep the topics this run produced.")] = False,
    loader_workers: LoaderWorkersOpt = None,
    ray_peer: RayPeerOpt = False,
    spark_peer: SparkPeerOpt = False,
    kafka_tools: KafkaToolsOpt = False,
    output: Annotated[Path | None, typer.Option("--out", "-o", help="Write the results JSON here.")] = None,
    markdown: Annotated[Path | None, typer.Option("--markdown", help="Write the tables as markdown here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Benchmark the data plane: every rate next to the raw fetch rate of the same topic, measured in the same run."""
    cfg = run_guarded(load_cli_config, config, sets)
    from kbit_core.bench.dataplane import data_plane, data_plane_report
    from kbit_core.bench.dataplane.user_topic_bench import run_user_topic_bench

    chosen = [run_guarded(data_plane.parse_variant, v) for v in variants] if variants else None
    _check_choices(clients or [], loader_workers or [])
    wanted = [name for name, on in zip(PEER_NAMES, (kafka_tools, ray_peer, spark_peer), strict=True) if on]
    peers = _peers() if wanted else {}
    comparisons = {name: peers[name][0] for name in wanted}
    if cfg.source.topic is not None:  # a user's topic: its snapshot is measured, nothing produced
        results = run_guarded(run_user_topic_bench, cfg, clients or None, repeats, loader_workers or (), comparisons)
    else:
        results = run_guarded(
            data_plane.run_data_plane,
            cfg,
            records=records,
            variants=chosen,
            datasets=[run_guarded(_named_dataset, cfg, name) for name in datasets] if datasets else None,
            clients=clients or None,
            repeats=repeats,
            rss_sizes=_sizes(rss_records) if rss else None,
            keep_topics=keep_topics,
            progress=not as_json,
            peers=comparisons,
            loader_workers=loader_workers or (),
        )
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2))
    if markdown:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(data_plane_report.markdown(results))
    if as_json:
        print_json(results)
    else:
        _print_tables(data_plane_report, results, {name: peers[name][1] for name in wanted}, output)


def _check_choices(clients: list[str], loader_workers: list[str]) -> None:
    for client in clients:
        if client not in ("confluent", "kafka-python"):
            raise typer.BadParameter(f"unknown client {client!r}; use confluent or kafka-python")
    known = get_args(ReaderConfig.model_fields["workers"].annotation)
    for workers in loader_workers:
        if workers not in known:
            raise typer.BadParameter(f"unknown reader.workers {workers!r}; use {', '.join(known)}")


def _named_dataset(cfg: KbitConfig, name: str) -> DatasetConfig:
    """``cfg``'s dataset section under another dataset ``name`` (its size, seed and token settings kept)."""
    try:
        return DatasetConfig.model_validate(cfg.dataset.model_dump() | {"name": name})
    except ValidationError as exc:
        raise ConfigError(f"--datasets {name}: {exc.errors()[0]['msg']}") from None


def _print_tables(report: ModuleType, results: dict, peer_tables: dict[str, Callable], output: Path | None) -> None:
    """The run's tables for the terminal: the rows, the targets, then each peer's comparison."""
    out.print(report.results_table(results))
    out.print(report.loader_workers_table(results))
    out.print(report.targets_table(results))
    for name, table in peer_tables.items():
        out.print(table(results[name]))
    if output:
        out.print(f"results: {output}")


def register(app: typer.Typer) -> None:
    """Add `bench-data` to the root app."""
    app.command("bench-data")(bench_data)

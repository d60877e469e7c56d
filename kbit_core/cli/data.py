"""`kbit produce` (write a dataset variant into Kafka, with its exact offset manifest) and `kbit inspect TOPIC`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kbit_core.checks import check_topic_name
from kbit_core.cli.common import PRODUCE_STOPPED, ConfigOpt, JsonOpt, SetOpt, console, print_json, run_guarded
from kbit_core.cli.stream import produce_stream
from kbit_core.cli.topic_view import print_user_topic, user_topic_facts
from kbit_core.config import COMPRESSIONS, FORMATS, KbitConfig, deep_merge, load_config, nest_dotted, parse_overrides
from kbit_core.errors import TopicError
from kbit_core.kafka import admin, manifest_registry
from kbit_core.kafka.contents import TopicCheck, check_topic_and_records
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.produce import produce_dataset

out = Console()

FormatOpt = Annotated[str | None, typer.Option("--format", "-f", help="|".join(FORMATS))]
LayoutOpt = Annotated[str | None, typer.Option("--layout", "-l", help="list (floats in [0,1]) | bytes (uint8)")]
CompressionOpt = Annotated[str | None, typer.Option("--compression", help="|".join(COMPRESSIONS))]
RecordsOpt = Annotated[int | None, typer.Option("--records", "-n", help="Records to produce.")]
PartitionsOpt = Annotated[int | None, typer.Option("--partitions", "-p", help="Topic partitions.")]
TopicOpt = Annotated[str | None, typer.Option("--topic", "-t", help="Topic name (derived when unset).")]
RecreateOpt = Annotated[bool, typer.Option("--recreate", help="Delete the topic and produce it again.")]
PerMessageOpt = Annotated[
    int | None, typer.Option("--records-per-message", "-k", help="Records grouped into one message.")
]
ClientOpt = Annotated[str | None, typer.Option("--client", help="confluent | kafka-python")]
StreamOpt = Annotated[
    bool,
    typer.Option(
        "--stream",
        help="Append to the stream topic at --rate instead (live producer; --records then counts stream records).",
    ),
]
RateOpt = Annotated[float | None, typer.Option("--rate", help="--stream: records per second.")]
DurationOpt = Annotated[float | None, typer.Option("--duration", help="--stream: seconds to produce.")]


def _config_with_flags(config: Path | None, sets: list[str] | None, flags: dict[str, Any]) -> KbitConfig:
    """The profile, then --set overrides, then the explicit flags (the most specific wins)."""
    given = nest_dotted({key: value for key, value in flags.items() if value is not None})
    return load_config(config, deep_merge(parse_overrides(sets or []), given))


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def manifest_table(m: Manifest) -> Table:
    table = Table(title=f"manifest {m.topic}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    ds = m.dataset
    rows = [
        (
            "dataset",
            f"{ds.name} seed={ds.seed} records={ds.num_records:,} shape={'x'.join(map(str, ds.image_shape))} "
            f"classes={ds.num_classes}",
        ),
        ("variant", f"{m.variant.name} ({m.variant.records_per_message} record(s)/message)"),
        ("schema fingerprint", m.schema_fingerprint),
        ("records / messages", f"{m.num_records:,} / {m.num_messages:,}"),
        ("value MB / wire MB", f"{_mb(m.value_bytes)} / {_mb(m.wire_bytes)}"),
        ("bytes per record", f"{m.value_bytes / max(m.num_records, 1):,.1f}"),
        (
            "produce",
            f"{m.produce_seconds:.2f} s, {m.num_records / max(m.produce_seconds, 1e-9):,.0f} rec/s, "
            f"{m.value_bytes / 1e6 / max(m.produce_seconds, 1e-9):,.1f} MB/s ({m.client})",
        ),
        ("offsets", " ".join(m.offset_strings())),
        ("created", f"{m.created_at:%Y-%m-%d %H:%M:%S %Z} by kbit {m.kbit_version}"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def partitions_table(m: Manifest, check: TopicCheck | None = None) -> Table:
    """One row per partition: its offsets, messages, records and MB, and with a ``check`` what the broker holds.
    Offsets share a column ('first..last') so that the live check fits 80 columns."""
    table = Table(title="partitions")
    columns = ["part", "offsets", "messages", "records", "MB"]
    if check is not None:
        columns += ["earliest", "end", "live"]
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    for p in m.partitions:
        row = [
            str(p.partition),
            f"{p.first_offset}..{p.last_offset}",
            f"{p.num_messages:,}",
            f"{p.num_records:,}",
            _mb(p.value_bytes),
        ]
        if check is not None:
            row += [
                str(check.earliest.get(p.partition, "-")),
                str(check.ends.get(p.partition, "-")),
                "[red]differs[/]" if p.partition in check.differing else "[green]ok[/]",
            ]
        table.add_row(*row)
    return table


def produce(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    fmt: FormatOpt = None,
    layout: LayoutOpt = None,
    compression: CompressionOpt = None,
    records: RecordsOpt = None,
    partitions: PartitionsOpt = None,
    topic: TopicOpt = None,
    recreate: RecreateOpt = False,
    per_message: PerMessageOpt = None,
    client: ClientOpt = None,
    stream: StreamOpt = False,
    rate: RateOpt = None,
    duration: DurationOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Produce the dataset into Kafka as one variant and print its offset manifest (reuses a matching topic);
    with --stream, append to the live stream topic at a target rate instead."""
    cfg = run_guarded(
        _config_with_flags,
        config,
        sets,
        {
            "produce.variant.format": fmt,
            "produce.variant.layout": layout,
            "produce.variant.compression": compression,
            "produce.variant.records_per_message": per_message,
            "stream.records" if stream else "dataset.num_records": records,
            "produce.partitions": partitions,
            "stream.topic" if stream else "produce.topic": topic,
            "produce.recreate": recreate or None,
            "produce.client": client,
            "stream.rate": rate,
            "stream.duration_s": duration,
        },
    )
    if stream:
        produce_stream(cfg, as_json)
        return
    manifest = run_guarded(produce_dataset, cfg, progress=not as_json, on_interrupt=PRODUCE_STOPPED)
    if as_json:
        print_json(
            {"manifest_path": str(manifest_path(cfg.workdir, manifest.topic)), **manifest.model_dump(mode="json")}
        )
        return
    out.print(manifest_table(manifest))
    out.print(partitions_table(manifest))
    out.print(f"manifest: {escape(str(manifest_path(cfg.workdir, manifest.topic)))}")


def inspect(
    topic: Annotated[str, typer.Argument(help="Topic to inspect.")],
    config: ConfigOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a topic's saved manifest and check it live: partitions, exact end offsets and every record's identity."""
    cfg = run_guarded(_config_with_flags, config, sets, {})
    found = run_guarded(_inspect, cfg, topic)
    if isinstance(found, dict):  # a topic kbit did not write
        print_json(found) if as_json else print_user_topic(out, found)
        if found.get("snapshot", {}).get("moved_on"):
            raise typer.Exit(code=1)
        return
    check, manifest = found
    if as_json:
        print_json(
            {
                "topic": topic,
                "ok": check.holds_manifest,
                "exists": check.exists,
                "partitions": check.partitions,
                "earliest": check.earliest,
                "ends": check.ends,
                "problems": check.problems,
                "manifest": manifest.model_dump(mode="json"),
            }
        )
    else:
        out.print(manifest_table(manifest))
        out.print(partitions_table(manifest, check))
        for problem in check.problems:
            out.print(f"[bold red]differs:[/] {escape(problem)}")
        if check.holds_manifest:
            out.print(f"[green]topic {escape(topic)} holds exactly its manifest[/]")
    if not check.holds_manifest:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add `produce` and `inspect` to the root app."""
    app.command("produce")(produce)
    app.command("inspect")(inspect)


def _inspect(cfg: KbitConfig, topic: str) -> tuple[TopicCheck, Manifest] | dict[str, Any]:
    """kbit's topic checked against its manifest, or the facts of a topic kbit did not write."""
    check_topic_name(topic, "TOPIC")
    path = manifest_path(cfg.workdir, topic)
    if path.is_file():
        manifest = Manifest.load(path)
    else:
        registered = manifest_registry.lookup(cfg.kafka, topic)
        if registered is None or registered.manifest is None:
            if not admin.topic_exists(cfg.kafka, topic):
                raise TopicError(
                    f"topic {topic!r} is not on the {admin.describe_broker(cfg.kafka)}; produce it with `kbit produce`"
                )
            return user_topic_facts(cfg, topic, None)
        manifest = registered.manifest
        console.print(
            f"manifest recorded in {manifest_registry.REGISTRY_TOPIC} by {escape(registered.owner)}", highlight=False
        )
    if not manifest.kbit_wrote_it:
        return user_topic_facts(cfg, topic, manifest)
    return check_topic_and_records(cfg.kafka, manifest), manifest

"""`kbit produce` (write a dataset variant into Kafka, with its exact offset manifest) and `kbit inspect TOPIC`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kbit_core.cli.common import PRODUCE_STOPPED, ConfigOpt, JsonOpt, SetOpt, print_json, run_guarded
from kbit_core.cli.stream import produce_stream
from kbit_core.config import COMPRESSIONS, FORMATS, KbitConfig, deep_merge, load_config, nest_dotted, parse_overrides

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
    from kbit_core.cli.topic_view import manifest_table, partitions_table
    from kbit_core.kafka.manifest import manifest_path
    from kbit_core.produce import produce_dataset  # after the config: its errors answer before torch is imported

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
    from kbit_core.cli import topic_view  # after the config: its errors answer before the Kafka clients load

    found = run_guarded(topic_view.inspect_topic, cfg, topic)
    if not topic_view.show_inspected(out, topic, found, as_json):
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add `produce` and `inspect` to the root app."""
    app.command("produce")(produce)
    app.command("inspect")(inspect)

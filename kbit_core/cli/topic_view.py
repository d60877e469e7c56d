"""What `kbit produce` and `kbit inspect` show of a topic: kbit's manifest checked live against the broker, or a topic
kbit did not write with its partitions' offsets and record times, and its snapshot if any."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kbit_core.checks import check_topic_name
from kbit_core.cli.common import console, print_json
from kbit_core.config import KbitConfig
from kbit_core.errors import TopicError
from kbit_core.kafka import admin, manifest_registry
from kbit_core.kafka.contents import TopicCheck, check_topic_and_records
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.kafka.snapshot import edge_timestamps, moved_on, topic_offsets


def user_topic_facts(cfg: KbitConfig, topic: str, snapshot: Manifest | None) -> dict[str, Any]:
    """What the broker holds of ``topic`` (id, each partition's low and high watermarks and first and last record
    times), and its snapshot's state when this workdir or the registry has one."""
    offsets = topic_offsets(cfg.kafka, topic)
    times = edge_timestamps(cfg.kafka, topic, offsets.bounds)
    partitions = [
        {
            "partition": p,
            "low": low,
            "high": high,
            "records": high - low,
            "first_time": _iso(times[p][0]) if p in times else None,
            "last_time": _iso(times[p][1]) if p in times else None,
        }
        for p, (low, high) in sorted(offsets.bounds.items())
    ]
    facts: dict[str, Any] = {
        "topic": topic,
        "kbit_created": False,
        "topic_id": offsets.topic_id,
        "partitions": partitions,
    }
    if snapshot is not None:
        facts["snapshot"] = {
            "path": str(manifest_path(cfg.workdir, topic)),
            "records": snapshot.num_records,
            "taken_at": snapshot.source.taken_at.isoformat() if snapshot.source else None,
            "moved_on": moved_on(cfg.kafka, snapshot),
        }
    return facts


def print_user_topic(out: Console, facts: dict[str, Any]) -> None:
    table = Table(title=f"topic {facts['topic']} (not created by kbit: read only)")
    for column in ("partition", "low", "high", "records", "first record", "last record"):
        table.add_column(column, justify="right" if column in ("partition", "low", "high", "records") else "left")
    for p in facts["partitions"]:
        table.add_row(
            str(p["partition"]),
            str(p["low"]),
            str(p["high"]),
            f"{p['records']:,}",
            p["first_time"] or "-",
            p["last_time"] or "-",
        )
    out.print(table)
    out.print(f"topic id {facts['topic_id'] or 'unknown'}")
    snapshot = facts.get("snapshot")
    if snapshot is None:
        out.print(f"no snapshot yet: train on it with source.topic={escape(facts['topic'])} and a source.mapping")
        return
    out.print(f"snapshot {escape(snapshot['path'])}: {snapshot['records']:,} records, taken {snapshot['taken_at']}")
    for problem in snapshot["moved_on"]:
        out.print(f"[bold red]moved on:[/] {escape(problem)}")


def _iso(millis: int) -> str:
    return datetime.fromtimestamp(millis / 1000, UTC).isoformat(timespec="milliseconds")


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


def inspect_topic(cfg: KbitConfig, topic: str) -> tuple[TopicCheck, Manifest] | dict[str, Any]:
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


def show_inspected(
    out: Console, topic: str, found: tuple[TopicCheck, Manifest] | dict[str, Any], as_json: bool
) -> bool:
    """Print what inspect_topic found, as tables or one JSON document; whether the topic is as recorded."""
    if isinstance(found, dict):  # a topic kbit did not write
        print_json(found) if as_json else print_user_topic(out, found)
        return not found.get("snapshot", {}).get("moved_on")
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
        return check.holds_manifest
    out.print(manifest_table(manifest))
    out.print(partitions_table(manifest, check))
    for problem in check.problems:
        out.print(f"[bold red]differs:[/] {escape(problem)}")
    if check.holds_manifest:
        out.print(f"[green]topic {escape(topic)} holds exactly its manifest[/]")
    return check.holds_manifest

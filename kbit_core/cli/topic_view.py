"""`kbit inspect` of a topic kbit did not write: its partitions' offsets and record times, and its snapshot if any."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kbit_core.config import KbitConfig
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

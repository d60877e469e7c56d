"""Apache Kafka's own performance tools next to kbit, on the same topic and broker, in the same run.

``ConsumerPerformance`` (kafka-tools) is what a Kafka engineer trusts as the consumer ceiling: it reads the
variant's whole topic (every partition) and reports its fetch rate, without the group's rebalance time. kbit's raw
fetch and its read+decode (the fast decoder) read the same records, alternating with it repeat by repeat so load
that drifts on a shared machine hits both. ``ProducerPerformance`` sends records of the topic's mean message size
with kbit's producer settings (acks=all, idempotence, the variant's compression, ``produce.linger_ms`` and
``produce.batch_size_bytes``); kbit's producer backend sends the same payload (like ProducerPerformance, one
payload of random capital letters for every record) the same number of times. Ratios are kbit over the tool, from
records/s: both count the same records (ConsumerPerformance's MB also count keys, kbit's values only).

The tool's rate is its own in-JVM figure (``fetch.nMsg.sec``: from the group's assignment to its last record, so
neither the JVM's start nor the rebalance is in it), never the wall time of its process. Its JIT warm-up and first
fetch are still inside it: on a short topic (a fetch under :data:`MIN_TOOL_FETCH_S`) that start weighs on the
tool's rate and the ratio favours kbit (the 2.1-9.3x once reported came from 20,000-record topics), so each
comparison records how long the tool fetched and says whether it was long enough to be like for like.
"""

from __future__ import annotations

import random
import re
import statistics
import string
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from kbit_core.bench.dataplane.data_plane import timed_pass, whole_topic_blocks
from kbit_core.bench.dataplane.peer_harness import comparison_head, peer_codec
from kbit_core.brokers.kafka_release import run_kafka_tool
from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.reader import RangeReader
from kbit_core.errors import KbitError
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest
from kbit_core.kafka.producers import DeliveryLedger, delivery_timeout_ms, make_producer

TARGET_FETCH_RATIO = 0.9  # kbit's raw fetch over ConsumerPerformance
TARGET_DECODE_RATIO = 0.8  # read+decode of a bytes layout over ConsumerPerformance
TOOL_TIMEOUT_S = 600
# The tool's fetch must last this long for its rate to be its steady one: its first ~0.5 s run at 0.1-0.6x of its
# later rate (measured with --show-detailed-stats on a 200,000-record topic, 2026-11-27)
MIN_TOOL_FETCH_S = 1.0
MIB = 2**20
# Before the timed repeats each reader reads the topic once untimed, so that neither meets a cold page cache (the
# topic's segments, the tool's jars) or the broker's cold fetch path in a timed run. Each ConsumerPerformance run
# still starts a JVM of its own, whose JIT warm-up is inside its timed region.
WARMUP = "one untimed pass of kbit's reader and one untimed ConsumerPerformance run before the timed repeats"
_PRODUCER_SUMMARY = re.compile(r"^(\d+) records sent, ([\d.]+) records/sec \(")


@dataclass(frozen=True)
class Rate:
    """Records and megabytes (10^6 bytes) per second of one timed run."""

    records_per_s: float
    mb_per_s: float


@dataclass(frozen=True)
class ToolFetch(Rate):
    """ConsumerPerformance's own fetch rate, with how long its fetch took (its ``fetch.time.ms``)."""

    fetch_seconds: float = 0.0


def parse_consumer_performance(output: str) -> ToolFetch:
    """ConsumerPerformance's summary line: its fetch rate (rebalance time excluded) and fetch time. Its MB are
    MiB."""
    lines = [line for line in output.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("start.time,"):
            row = dict(zip([c.strip() for c in line.split(",")], [v.strip() for v in lines[i + 1].split(",")]))
            mb_per_s = float(row["fetch.MB.sec"]) * MIB / 1e6
            return ToolFetch(float(row["fetch.nMsg.sec"]), mb_per_s, float(row["fetch.time.ms"]) / 1000)
    raise KbitError(f"no ConsumerPerformance summary in its output: {output.strip()[-300:]!r}")


def parse_producer_performance(output: str, record_size: int) -> Rate:
    """ProducerPerformance's last line ('N records sent, R records/sec (M MB/sec), ...'); the MB/s from its
    records/s (its own are MiB, rounded to 0.01)."""
    for line in reversed(output.splitlines()):
        found = _PRODUCER_SUMMARY.match(line.strip())
        if found:
            return Rate(float(found[2]), float(found[2]) * record_size / 1e6)
    raise KbitError(f"no ProducerPerformance summary in its output: {output.strip()[-300:]!r}")


def consumer_performance(cfg: KbitConfig, topic: str, records: int) -> ToolFetch:
    """ConsumerPerformance reading ``records`` records of ``topic`` from its start, in a group of its own."""
    args = ["--bootstrap-server", cfg.kafka.resolved_bootstrap(), "--topic", topic, "--num-records", str(records)]
    args += ["--group", f"kbit-perf-{uuid.uuid4().hex[:8]}", "--timeout", str(TOOL_TIMEOUT_S * 1000)]
    return parse_consumer_performance(run_kafka_tool("ConsumerPerformance", args))


def producer_settings(cfg: KbitConfig, compression: str) -> dict[str, str]:
    """kbit's producer settings as Java client properties."""
    return {
        "acks": "all",
        "enable.idempotence": "true",
        "compression.type": compression,
        "linger.ms": str(cfg.produce.linger_ms),
        "batch.size": str(cfg.produce.batch_size_bytes),
    }


def producer_performance(cfg: KbitConfig, topic: str, records: int, record_size: int, compression: str) -> Rate:
    props = {"bootstrap.servers": cfg.kafka.resolved_bootstrap(), **producer_settings(cfg, compression)}
    args = ["--topic", topic, "--num-records", str(records), "--record-size", str(record_size), "--throughput", "-1"]
    args += ["--producer-props", *(f"{k}={v}" for k, v in props.items())]
    return parse_producer_performance(run_kafka_tool("ProducerPerformance", args), record_size)


def kbit_producer(cfg: KbitConfig, topic: str, records: int, payload: bytes, compression: str) -> Rate:
    """kbit's producer backend sending ``payload`` ``records`` times round-robin over the topic's partitions,
    every delivery report settled; timed from the first send to the end of the flush."""
    partitions = cfg.produce.partitions
    ledger = DeliveryLedger(topic, partitions, cfg.kafka)
    backend = make_producer(cfg.kafka, cfg.produce, compression)  # type: ignore[arg-type]
    try:
        t0 = time.perf_counter()
        for i in range(records):
            backend.send(topic, i % partitions, str(i).encode(), payload, ledger.callback(1, len(payload)))
        backend.flush(delivery_timeout_ms(cfg.kafka) / 1000, count_wire_bytes=False)
        seconds = time.perf_counter() - t0
    finally:
        backend.close()
    if ledger.delivered_records != records:
        raise KbitError(f"{topic}: kbit's producer delivered {ledger.delivered_records} of {records} records")
    return Rate(records / seconds, records * len(payload) / 1e6 / seconds)


def _into_scratch(cfg: KbitConfig, produce: Callable[[str], Rate]) -> Rate:
    """``produce`` into a fresh topic of ``produce.partitions`` partitions, deleted afterwards."""
    topic = f"kbit-perf-{uuid.uuid4().hex[:8]}"
    admin.create_topic(cfg.kafka, topic, cfg.produce.partitions)
    try:
        return produce(topic)
    finally:
        admin.delete_topic(cfg.kafka, topic)


def compare_producers(cfg: KbitConfig, manifest: Manifest, repeats: int) -> dict[str, Any]:
    """ProducerPerformance and kbit's producer at the variant's compression and mean message size, alternating
    ``repeats`` times, each run into a fresh topic; medians and kbit's ratio."""
    records, compression = manifest.num_messages, manifest.variant.compression
    size = max(1, round(manifest.value_bytes / max(1, records)))
    payload = "".join(random.choices(string.ascii_uppercase, k=size)).encode()
    tool, kbit = [], []
    for _ in range(repeats):
        tool.append(_into_scratch(cfg, lambda topic: producer_performance(cfg, topic, records, size, compression)))
        kbit.append(_into_scratch(cfg, lambda topic: kbit_producer(cfg, topic, records, payload, compression)))
    return {
        "records": records,
        "record_bytes": size,
        "settings": producer_settings(cfg, compression),
        "producer_performance": asdict(_median(tool)),
        "kbit": asdict(_median(kbit)),
        "kbit_over_tool": _median(kbit).records_per_s / _median(tool).records_per_s,
    }


def compare_consumers(cfg: KbitConfig, manifest: Manifest, client: ClientName, repeats: int) -> dict[str, Any]:
    """ConsumerPerformance and kbit's raw fetch and read+decode (fast decoder) with ``client`` on the whole topic,
    alternating ``repeats`` times after one untimed pass of each (WARMUP); medians and kbit's ratios."""
    ranges = whole_topic_blocks(cfg, manifest)
    codec = peer_codec(manifest.model_dump_json())
    mb = manifest.value_bytes / 1e6
    tool, fetch, decode = [], [], []
    with RangeReader(
        cfg.kafka, cfg.reader.model_copy(update={"decode_processes": 0}), manifest.topic, codec, client
    ) as r:
        timed_pass(r, ranges, {"fast": codec})
        consumer_performance(cfg, manifest.topic, manifest.num_messages)
        for _ in range(repeats):
            tool.append(consumer_performance(cfg, manifest.topic, manifest.num_messages))
            fetched, decoded, fetch_s, decode_s = timed_pass(r, ranges, {"fast": codec})
            if fetched != manifest.num_messages or decoded["fast"] != manifest.num_records:
                raise KbitError(f"{manifest.topic}: kbit read {fetched} messages / {decoded['fast']} records")
            fetch.append(Rate(fetched / fetch_s, mb / fetch_s))
            decode.append(Rate(fetched / (fetch_s + decode_s["fast"]), mb / (fetch_s + decode_s["fast"])))
    base = _median(tool).records_per_s
    tool_seconds = statistics.median(t.fetch_seconds for t in tool)
    return {
        "client": client,
        "warmup": WARMUP,
        "consumer_performance": asdict(_median(tool)),
        "tool_fetch_seconds": tool_seconds,
        "like_for_like": tool_seconds >= MIN_TOOL_FETCH_S,
        "kbit_fetch": asdict(_median(fetch)),
        "kbit_read_decode": asdict(_median(decode)),
        "fetch_over_tool": _median(fetch).records_per_s / base,
        "read_decode_over_tool": _median(decode).records_per_s / base,
    }


def _median(rates: list[Rate]) -> Rate:
    return Rate(statistics.median(r.records_per_s for r in rates), statistics.median(r.mb_per_s for r in rates))


def compare(cfg: KbitConfig, manifest: Manifest, kbit_rows: list[dict[str, Any]], repeats: int = 3) -> dict[str, Any]:
    """The kafka-tools comparison of one variant: each client of ``kbit_rows`` against ConsumerPerformance, and
    kbit's producer against ProducerPerformance; with the targets that apply."""
    consumers = [compare_consumers(cfg, manifest, row["client"], repeats) for row in kbit_rows]
    return {
        **comparison_head(manifest),
        "messages": manifest.num_messages,
        "consumers": consumers,
        "producer": compare_producers(cfg, manifest, repeats),
        "targets": consumer_targets(manifest.variant.name, manifest.variant.layout, consumers),
    }


def consumer_targets(variant: str, layout: str, consumers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fetch target of each consumer comparison (and read+decode for a bytes layout), each naming a tool run too
    short to be like for like."""
    targets = []
    for c in consumers:
        who = f"{variant} ({c['client']})"
        if not c["like_for_like"]:
            who += f" [tool fetched {c['tool_fetch_seconds']:.2f} s < {MIN_TOOL_FETCH_S:g} s: its warm-up favours kbit]"
        targets.append(_target(f"{who} fetch", TARGET_FETCH_RATIO, c["fetch_over_tool"]))
        if layout == "bytes":
            targets.append(_target(f"{who} read+decode", TARGET_DECODE_RATIO, c["read_decode_over_tool"]))
    return targets


def _target(what: str, limit: float, value: float) -> dict[str, Any]:
    return {"target": f"{what} >= {limit}x ConsumerPerformance", "value": round(value, 3), "met": value >= limit}


def tools_table(comparisons: list[dict[str, Any]]) -> Table:
    """MB/s of Kafka's tools and kbit per variant, with kbit's ratios (from records/s)."""
    table = Table(title="kbit vs Apache Kafka's ConsumerPerformance / ProducerPerformance (same topic, same run)")
    for column in ("variant", "what", "tool MB/s", "tool fetch s", "kbit MB/s", "kbit ÷ tool"):
        table.add_column(column, justify="left" if column in ("variant", "what") else "right")
    for c in comparisons:
        for r in c["consumers"]:
            tool = r["consumer_performance"]["mb_per_s"]
            seconds = f"{r['tool_fetch_seconds']:.2f}" + ("" if r["like_for_like"] else " (short)")
            for what, key, ratio in (
                ("fetch", "kbit_fetch", "fetch_over_tool"),
                ("read+decode", "kbit_read_decode", "read_decode_over_tool"),
            ):
                table.add_row(
                    c["variant"],
                    f"{what} ({r['client']})",
                    f"{tool:,.1f}",
                    seconds,
                    f"{r[key]['mb_per_s']:,.1f}",
                    f"{r[ratio]:.2f}",
                )
        p = c["producer"]
        table.add_row(
            c["variant"],
            f"produce ({p['settings']['compression.type']}, {p['record_bytes']} B)",
            f"{p['producer_performance']['mb_per_s']:,.1f}",
            "",
            f"{p['kbit']['mb_per_s']:,.1f}",
            f"{p['kbit_over_tool']:.2f}",
        )
    return table

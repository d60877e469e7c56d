"""What every peer reader of the data-plane benchmark shares: read kbit's topic with another reader, the way kbit's
reader is timed, and set it beside kbit's rows of the same run.

A peer module keeps only what is its own: how the peer reads the manifest's offsets and decodes them (with
:func:`peer_codec`, the codec kbit's reader uses). :func:`timed_reads` times it (one untimed warm-up, then the
repeats), :func:`peer_row` makes one reader's row, and a :class:`PeerReader` compares its rows with kbit's
read+decode rate per client and shows them as a table. Apache Kafka's tools (``kafka_tools``) alternate with kbit's
reader repeat by repeat instead, and share the codec and the comparison's head.

On a snapshot of a user's topic in the Confluent Avro framing (``source.value_format: confluent-avro``) a peer reads
it the way its own users do instead, without kbit's codec: :func:`framed_avro` gives it the writer schema and the
mapped fields (Spark's ``from_avro`` past the 5-byte header, confluent-kafka's ``AvroDeserializer`` in Ray).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from kbit_core.bench.dataplane.peer_table import peer_table, ratios_text
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.formats import Codec
from kbit_core.formats.confluent.source import SchemaSource, configured_or_stack_registry
from kbit_core.kafka.manifest import Manifest, manifest_codec

# A peer's measurement: (config, manifest, repeats) -> one row per reader setting (see peer_row)
Measure = Callable[[KbitConfig, Manifest, int], list[dict[str, Any]]]


@functools.lru_cache(maxsize=8)
def peer_codec(manifest_json: str) -> Codec:
    """The manifest's codec with kbit's fast decoder, built once per process (Ray's and Spark's workers keep theirs
    between reads, so the timed reads find it warm as kbit's reader finds its own)."""
    return manifest_codec(Manifest.model_validate_json(manifest_json), "fast")


@dataclass(frozen=True)
class FramedAvro:
    """A user's topic in the Confluent Avro framing as a peer's users read it: ``writer_schema`` (JSON, the subject's
    latest: what one passes to from_avro), the mapping's value ``fields`` (dotted paths) and confluent-kafka's
    registry client settings (``registry``, secrets revealed: only for the peer's own client)."""

    topic: str
    writer_schema: str
    fields: tuple[str, ...]
    registry: dict[str, Any]


def framed_avro(cfg: KbitConfig, manifest: Manifest) -> FramedAvro | None:
    """How a peer reads ``manifest``'s topic when it is a user's in the Confluent Avro framing; None for kbit's own
    topics (the peer decodes with :func:`peer_codec`). ConfigError for a user's topic in another value format."""
    snapshot = manifest.source
    if snapshot is None:
        return None
    if snapshot.value_format != "confluent-avro":
        raise ConfigError(
            f"bench-data's peers read a user's topic in the Confluent Avro framing only (source.value_format "
            f"confluent-avro); topic {manifest.topic!r} is {snapshot.value_format}: run it without them"
        )
    assert snapshot.mapping is not None
    if not snapshot.mapping.value_fields:
        raise ConfigError(
            f"source.mapping of topic {manifest.topic!r} reads no field of the values: no peer to compare"
        )
    registry = configured_or_stack_registry(cfg.registry)
    subject = snapshot.value_options.get("subject", f"{manifest.topic}-value")
    _, schema = SchemaSource(registry).latest(subject)
    return FramedAvro(manifest.topic, schema.schema_str, tuple(snapshot.mapping.value_fields), registry.client_conf())


def timed_reads(read: Callable[[], int], repeats: int) -> tuple[int, list[float]]:
    """``read`` once untimed (it starts the peer's workers and their imports), then ``repeats`` times timed; the
    records the last read returned and each timed read's seconds."""
    records, seconds = read(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        records = read()
        seconds.append(time.perf_counter() - t0)
    return records, seconds


def peer_row(reader: str, manifest: Manifest, records: int, seconds: list[float], **extra: Any) -> dict[str, Any]:
    """One reader setting's row: median records/s, the records it returned and those it left out (counted, never
    lost silently), each timed read's seconds, and what else the peer reports."""
    median_s = statistics.median(seconds)
    return {
        "reader": reader,
        "records": records,
        "records_missing": manifest.num_records - records,
        "records_per_s": records / median_s if median_s > 0 else float("nan"),
        "seconds": seconds,
        **extra,
    }


def comparison_head(manifest: Manifest) -> dict[str, Any]:
    """What every comparison names first: the variant, its topic and its records."""
    return {"variant": manifest.variant.name, "topic": manifest.topic, "records": manifest.num_records}


@dataclass(frozen=True)
class PeerReader:
    """A peer reader: its key in a comparison (which holds its rows under ``key`` and kbit's leads under
    ``kbit_over_<key>``), its table's title, and how it measures."""

    key: str
    title: str
    measure: Measure

    def compare(
        self, cfg: KbitConfig, manifest: Manifest, kbit_rows: list[dict[str, Any]], repeats: int = 3
    ) -> dict[str, Any]:
        """The peer on ``manifest``'s topic next to kbit's rows for it (``bench-data`` rows, one per client, measured
        in the same run): records/s of each, kbit's read+decode rate over each reader's (above 1: kbit is faster),
        and that target."""
        rows = self.measure(cfg, manifest, repeats)
        kbit = {row["client"]: row["decode_records_per_s"] for row in kbit_rows}
        ratios = {
            client: {row["reader"]: rate / row["records_per_s"] for row in rows if row["records_per_s"]}
            for client, rate in kbit.items()
        }
        return {
            **comparison_head(manifest),
            "kbit_records_per_s": kbit,
            self.key: rows,
            f"kbit_over_{self.key}": ratios,
            "targets": [
                {
                    "target": f"{manifest.variant.name} ({client}) read+decode faster than {reader}",
                    "value": round(r, 2),
                    "met": r > 1.0,
                }
                for client, by_reader in ratios.items()
                for reader, r in by_reader.items()
            ],
        }

    def table(self, comparisons: list[dict[str, Any]]) -> Table:
        """kbit's read+decode records/s per client next to each of the peer's readers, with kbit's leads."""
        return peer_table(
            self.title,
            comparisons,
            lambda c: (
                (
                    row["reader"],
                    row["records_per_s"],
                    ratios_text(by[row["reader"]] for by in c[f"kbit_over_{self.key}"].values()),
                    row["records_missing"],
                )
                for row in c[self.key]
            ),
        )

"""Ray Data's own bounded Kafka reader (``ray.data.read_kafka``) timed on kbit's topic, next to kbit's reader.

Ray reads exactly the manifest's offsets (per-partition ``start_offset``/``end_offset``) and decodes with
``map_batches`` through the same codec kbit's reader uses (the fast decoder), into the same arrays (indices,
labels, pixels); the records/s count every record that reached the driver through ``iter_batches``. Two Ray
settings: as shipped (Ray picks the block count) and tuned (``override_num_blocks`` = partitions). What
read_kafka supports and lacks is in docs/data_plane_benchmark.md. On a user's topic in the Confluent Avro framing
each value goes through confluent-kafka's ``AvroDeserializer`` instead (its writer schema fetched from the registry,
as a Ray user's pipeline does) and the mapped fields reach the driver as columns.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import numpy as np
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kbit_core.bench.dataplane import peer_harness
from kbit_core.bench.dataplane.peer_harness import PeerReader, peer_codec, peer_row, timed_reads
from kbit_core.config import KbitConfig
from kbit_core.formats.records import columns_of
from kbit_core.kafka.manifest import Manifest
from kbit_core.launch.ray_train import ensure_ray


def measure_read_kafka(cfg: KbitConfig, manifest: Manifest, repeats: int = 3) -> list[dict[str, Any]]:
    """One row per Ray setting (see ``peer_row``): median records/s over ``repeats`` reads after one untimed warm-up
    (it warms Ray's workers and their imports); Ray caps each end offset at the broker's reported high watermark."""
    framed = peer_harness.framed_avro(cfg, manifest)
    started = time.perf_counter()
    ensure_ray(cfg)  # first: Ray reads its environment at import
    init_s = time.perf_counter() - started
    # the `ray` extra: optional, and seconds to import
    import ray.data

    settings = {"ray_read_kafka": None, "ray_read_kafka_tuned": len(manifest.partitions)}
    rows = []
    for name, blocks in settings.items():
        records, seconds = timed_reads(lambda blocks=blocks: _read(ray.data, cfg, manifest, blocks, framed), repeats)
        rows.append(peer_row(name, manifest, records, seconds, override_num_blocks=blocks, ray_init_s=init_s))
    return rows


def _read(
    data: Any, cfg: KbitConfig, manifest: Manifest, blocks: int | None, framed: peer_harness.FramedAvro | None
) -> int:
    ranges = manifest.ranges()
    dataset = data.read_kafka(
        manifest.topic,
        bootstrap_servers=cfg.kafka.resolved_bootstrap(),
        start_offset={manifest.topic: {p: start for p, (start, _) in ranges.items()}},
        end_offset={manifest.topic: {p: stop for p, (_, stop) in ranges.items()}},
        override_num_blocks=blocks,
    )
    decode, argument = (_decode, manifest.model_dump_json()) if framed is None else (_deserialize, framed)
    decoded = dataset.map_batches(decode, fn_args=(argument,), batch_format="numpy", batch_size=None)
    return sum(len(batch["label"]) for batch in decoded.iter_batches(batch_size=None, batch_format="numpy"))


def _decode(batch: dict[str, np.ndarray], manifest_json: str) -> dict[str, np.ndarray]:
    """Kafka values -> kbit's arrays, with the manifest's fast decoder (built once per Ray worker process)."""
    decoded = peer_codec(manifest_json).decode(list(batch["value"]))
    return {"index": decoded.indices, "label": decoded.labels, "pixels": decoded.pixels}


@functools.lru_cache(maxsize=4)
def _deserializer(registry_json: str) -> AvroDeserializer:
    """confluent-kafka's AvroDeserializer on the registry, one per Ray worker process (its schema cache warm)."""
    return AvroDeserializer(SchemaRegistryClient(json.loads(registry_json)))


def _deserialize(batch: dict[str, np.ndarray], framed: peer_harness.FramedAvro) -> dict[str, np.ndarray]:
    """Confluent-framed Avro values -> the mapped fields (columns of Python values), by confluent-kafka's own
    deserializer; the last column is named ``label``, by which ``_read`` counts records as it does kbit's arrays."""
    deserialize = _deserializer(json.dumps(framed.registry, sort_keys=True, default=str))
    context = SerializationContext(framed.topic, MessageField.VALUE)
    records = [deserialize(value, context) for value in batch["value"]]
    columns = list(columns_of(records, framed.fields).values())
    named = {f"field{i}": np.array(column, dtype=object) for i, column in enumerate(columns[:-1])}
    return {**named, "label": np.array(columns[-1], dtype=object)}


RAY = PeerReader("ray", "kbit's reader vs ray.data.read_kafka (records/s, same topic, same run)", measure_read_kafka)
compare, peer_table = RAY.compare, RAY.table

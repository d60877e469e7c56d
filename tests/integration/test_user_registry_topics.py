"""A user's topic in the Confluent wire format, written by confluent-kafka's own AvroSerializer against the real
Schema Registry (Apicurio), trained on as kbit's dataset: its snapshot, the mapping checked against the registry's
schema, every record read back exactly once through the loaders, in the rank and in a worker process, and bad
records and a registry that is down named by topic, partition, offset and schema id."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError, CorruptRecordError, SchemaRegistryError
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.service import Service
from kbit_core.sharding import OffsetRange
from kbit_core.topic_dataset import snapshot_dataset
from tests.conftest import free_port
from tests.integration.user_topics import create_user_topic

pytestmark = pytest.mark.kafka

# The user's own schema: none of its names are kbit's.
GARMENT = {
    "type": "record",
    "name": "Garment",
    "namespace": "shop.catalogue",
    "fields": [
        {"name": "sku", "type": "long"},
        {"name": "photo", "type": {"type": "record", "name": "Photo", "fields": [{"name": "png", "type": "bytes"}]}},
        {"name": "kind", "type": "string"},
    ],
}
KINDS = ("boot", "coat", "shirt")
RECORDS = 120


def write_garments(broker: Any, registry: Service, topic: str) -> dict[int, tuple[bytes, str]]:
    """RECORDS garments over 2 partitions, serialized by confluent-kafka's AvroSerializer; each sku's photo and kind."""
    create_user_topic(broker, topic)
    serializer = AvroSerializer(SchemaRegistryClient({"url": registry.url, "timeout": 60}), json.dumps(GARMENT))
    rng = np.random.default_rng(7)
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{broker.port}"})
    written = {}
    for sku in range(RECORDS):
        photo, kind = rng.integers(0, 256, 16, dtype=np.uint8).tobytes(), KINDS[sku % 3]
        value = serializer(
            {"sku": sku, "photo": {"png": photo}, "kind": kind}, SerializationContext(topic, MessageField.VALUE)
        )
        producer.produce(topic, value, partition=sku % 2)
        written[sku] = (photo, kind)
    assert producer.flush(30) == 0
    return written


def garment_config(make_config: Any, registry: Service, topic: str, **mapping: Any) -> Any:
    source = {
        "topic": topic,
        "value_format": "confluent-avro",
        "mapping": {
            "features": ["photo.png"],
            "encoding": "bytes",
            "shape": [1, 4, 4],
            "dtype": "uint8",
            "label": "kind",
            **mapping,
        },
    }
    return make_config(
        {"source": source, "registry": {"url": registry.url}, "tracking": {"enabled": False}},
        shard__split_rates=[1.0],
        train__global_batch_size=8,
    )


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_registry_framed_user_topic_reads_back_every_record_once(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str, workers: str
) -> None:
    written = write_garments(broker, schema_registry, topic_name)
    cfg = garment_config(make_config, schema_registry, topic_name).override({"reader.workers": workers})
    manifest = snapshot_dataset(cfg)
    assert manifest.num_records == RECORDS and manifest.source.vocabulary == sorted(KINDS)
    # position -> sku: partition 0 holds the even skus in order, partition 1 the odd ones
    sku_at = [*range(0, RECORDS, 2), *range(1, RECORDS, 2)]
    loader = make_split_loader(cfg, manifest, "train", 0, 1)
    seen = []
    for batch in loader.iter_indexed():
        for index, x, y in zip(batch.indices.tolist(), batch.x, batch.y.tolist()):
            photo, kind = written[sku_at[index]]
            assert np.array_equal((x.numpy() * 255).round().astype(np.uint8).tobytes(), photo)
            assert manifest.source.vocabulary[y] == kind
            seen.append(index)
    loader.close()
    assert sorted(seen) == list(range(RECORDS))


def test_a_mapping_field_the_registry_schema_lacks_is_one_line_naming_subject_and_id(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str
) -> None:
    write_garments(broker, schema_registry, topic_name)
    cfg = garment_config(make_config, schema_registry, topic_name, features=["photo.jpeg"])
    with pytest.raises(ConfigError) as exc:
        snapshot_dataset(cfg)
    message = str(exc.value)
    assert "\n" not in message and "photo.jpeg" in message and f"{topic_name}-value" in message
    assert "id " in message


def test_bad_records_and_a_registry_that_is_down_are_named_by_topic_partition_offset_and_schema_id(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str
) -> None:
    write_garments(broker, schema_registry, topic_name)  # 60 records in each partition
    stranger = Producer({"bootstrap.servers": f"127.0.0.1:{broker.port}"})
    stranger.produce(topic_name, b'{"sku": 1}', partition=1)  # offset 60: not in the Confluent framing
    stranger.produce(topic_name, b"\x00" + (987654).to_bytes(4, "big") + b"\x02", partition=1)  # 61: unknown id
    assert stranger.flush(10) == 0
    cfg = garment_config(make_config, schema_registry, topic_name)
    with pytest.raises(CorruptRecordError, match="vocabulary: .* not in the Confluent framing.*partition=1, offset=60"):
        snapshot_dataset(cfg)  # discovering the labels
    manifest = snapshot_dataset(cfg.override({"reader.bad_records": "skip"}))
    codec = manifest_codec(manifest, "fast", cfg.registry)
    for block, where in [(OffsetRange(1, 0, 62), "offset=60"), (OffsetRange(1, 61, 62), "offset=61")]:
        with RangeReader(cfg.kafka, cfg.reader, topic_name, codec) as reader, pytest.raises(CorruptRecordError) as exc:
            list(reader.read([block]))
        assert "\n" not in str(exc.value) and f"topic={topic_name}, partition=1, {where}" in str(exc.value)
    assert "schema id 987654" in str(exc.value)
    skipping = cfg.reader.model_copy(update={"bad_records": "skip"})
    with RangeReader(cfg.kafka, skipping, topic_name, codec) as reader:
        read = sum(len(batch.indices) for _, batch in reader.read([OffsetRange(1, 0, 62)]))
        assert (read, reader.stats.skipped) == (60, 2)
    # a registry that is down is retried within registry.deadline_s, then named where reading stopped; it is the
    # registry's fault, not the records': never skipped as bad records
    down = cfg.override(
        {"registry.url": f"http://127.0.0.1:{free_port()}", "registry.deadline_s": 1, "registry.request_timeout_s": 0.5}
    )
    with RangeReader(cfg.kafka, skipping, topic_name, manifest_codec(manifest, "fast", down.registry)) as reader:
        with pytest.raises(SchemaRegistryError) as failed:
            list(reader.read([OffsetRange(0, 0, 60)]))
    message = str(failed.value)
    assert "\n" not in message and "did not answer for schema id" in message and "registry.deadline_s=1s" in message
    assert f"topic={topic_name}, partition=0, offset=0" in message and failed.value.schema_id is not None

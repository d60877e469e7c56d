"""A user's topic in the Confluent wire format, written by confluent-kafka's own AvroSerializer against the real
Schema Registry (Apicurio), trained on as kbit's dataset: its snapshot, the mapping checked against the registry's
schema, and every record read back exactly once through the loaders, in the rank and in a worker process."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError
from kbit_core.service import Service
from kbit_core.topic_dataset import snapshot_dataset
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

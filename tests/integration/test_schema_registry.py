"""Topics kbit did not write, in the Confluent framing, against the real Schema Registry (Apicurio) and the real
broker: written by confluent-kafka's own serializers and producer, decoded by kbit's RecordDecoders."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kbit_core.config import RegistryConfig
from kbit_core.errors import CorruptRecordError, SchemaRegistryError
from kbit_core.formats.confluent import confluent_decoder
from kbit_core.formats.schemas import kbit_pb2
from kbit_core.service import Service
from tests.conftest import free_port

V1 = {
    "type": "record",
    "name": "Reading",
    "namespace": "user.sensors",
    "fields": [
        {"name": "sensor", "type": "string"},
        {"name": "level", "type": "long"},
        {"name": "values", "type": {"type": "array", "items": "float"}},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}
# v2 adds a field with a default: a compatible evolution (BACKWARD)
V2 = {**V1, "fields": [*V1["fields"], {"name": "gain", "type": "double", "default": 1.5}]}
FIELDS = ["sensor", "level", "values", "note", "gain"]


def registry_settings(service: Service, **more: Any) -> RegistryConfig:
    return RegistryConfig(url=service.url, **more)


def write(broker: Any, topic: str, values: list[bytes]) -> None:
    """The user's own producer: a one-partition topic made with confluent-kafka's admin client, then filled."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    failed: list[Any] = []
    for value in values:
        producer.produce(topic, value, on_delivery=lambda err, _msg: failed.append(err) if err else None)
    assert producer.flush(30) == 0 and not failed


def read_values(broker: Any, topic: str, count: int) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": topic, "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    values: list[bytes] = []
    try:
        for _ in range(100):
            values += [m.value() for m in consumer.consume(count - len(values), 0.5) if m.error() is None]
            if len(values) == count:
                return values
    finally:
        consumer.close()
    raise AssertionError(f"read {len(values)} of {count} values from {topic}")


def serialize(serializer: Callable[..., bytes], topic: str, objects: list[Any]) -> list[bytes]:
    return [serializer(obj, SerializationContext(topic, MessageField.VALUE)) for obj in objects]


def readings(count: int, seed: int, with_gain: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        row = {
            "sensor": f"s{i % 3}",
            "level": int(rng.integers(-(2**40), 2**40)),
            "values": rng.random(4, dtype=np.float32).tolist(),
            "note": None if i % 2 else f"n{i}",
        }
        if with_gain:
            row["gain"] = float(rng.random())
        out.append(row)
    return out


def test_two_writer_schemas_decode_as_one_dataset_resolved_to_the_latest(
    broker: Any, schema_registry: Service, topic_name: str
) -> None:
    client = SchemaRegistryClient({"url": schema_registry.url, "timeout": 60})
    v1, v2 = readings(40, 1, False), readings(40, 2, True)
    values = serialize(AvroSerializer(client, json.dumps(V1)), topic_name, v1)
    values += serialize(AvroSerializer(client, json.dumps(V2)), topic_name, v2)
    write(broker, topic_name, values)
    read = read_values(broker, topic_name, len(values))
    assert len({v[1:5] for v in read}) == 2  # two writer schema ids on one topic

    for decoder in ("fast", "stock"):
        columns = confluent_decoder(
            registry_settings(schema_registry), topic_name, "avro", decoder=decoder
        ).decode_columns(read, FIELDS)
        stock = AvroDeserializer(
            client,
            client.get_latest_version(f"{topic_name}-value").schema,
            conf={"subject.name.strategy": topic_subject_name_strategy},
        )
        expected = [stock(v, SerializationContext(topic_name, MessageField.VALUE)) for v in read]
        for path in FIELDS:
            column = columns[path]
            got = column.tolist() if isinstance(column, np.ndarray) else column
            assert got == [record[path] for record in expected], (decoder, path)
        assert [row["gain"] for row in expected[:40]] == [1.5] * 40  # v1's records take v2's default


def test_writer_schema_names_the_subject_and_id(broker: Any, schema_registry: Service, topic_name: str) -> None:
    client = SchemaRegistryClient({"url": schema_registry.url, "timeout": 60})
    serialize(AvroSerializer(client, json.dumps(V2)), topic_name, readings(1, 0, True))
    schema = confluent_decoder(registry_settings(schema_registry), topic_name, "avro").writer_schema()
    assert schema.subject == f"{topic_name}-value" and schema.schema_id is not None
    assert {p: (f.kind, f.nullable) for p, f in schema.fields.items()} == {
        "sensor": ("string", False),
        "level": ("int", False),
        "values": ("array<float>", False),
        "note": ("string", True),
        "gain": ("float", False),
    }


def test_json_schema_and_protobuf_values_decode(broker: Any, schema_registry: Service, topic_name: str) -> None:
    client = SchemaRegistryClient({"url": schema_registry.url, "timeout": 60})
    json_topic, proto_topic = f"{topic_name}-json", f"{topic_name}-proto"
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    }
    docs = [{"x": i, "tags": [str(i)] * (i % 3)} for i in range(20)]
    write(broker, json_topic, serialize(JSONSerializer(json.dumps(schema), client), json_topic, docs))
    samples = [kbit_pb2.Sample(index=i, label=i % 10, pixels=bytes([i]) * 3, shape=[3]) for i in range(20)]
    proto = ProtobufSerializer(kbit_pb2.Sample, client, {"use.deprecated.format": False})
    write(broker, proto_topic, serialize(proto, proto_topic, samples))

    settings = registry_settings(schema_registry)
    for decoder in ("fast", "stock"):
        columns = confluent_decoder(settings, json_topic, "json", decoder=decoder).decode_columns(
            read_values(broker, json_topic, 20), ["x", "tags", "missing"]
        )
        assert columns == {"x": list(range(20)), "tags": [d["tags"] for d in docs], "missing": [None] * 20}
    decoder = confluent_decoder(settings, proto_topic, "protobuf")
    columns = decoder.decode_columns(read_values(broker, proto_topic, 20), ["index", "pixels", "shape"])
    assert columns == {"index": list(range(20)), "pixels": [bytes([i]) * 3 for i in range(20)], "shape": [[3]] * 20}
    assert decoder.writer_schema().fields["pixels"].kind == "bytes"


def test_bad_values_are_named_in_one_line(schema_registry: Service, topic_name: str) -> None:
    client = SchemaRegistryClient({"url": schema_registry.url, "timeout": 60})
    good = serialize(AvroSerializer(client, json.dumps(V2)), topic_name, readings(3, 0, True))
    decoder = confluent_decoder(registry_settings(schema_registry), topic_name, "avro")
    unknown = b"\x00" + (987654).to_bytes(4, "big") + good[0][5:]
    with pytest.raises(CorruptRecordError) as exc:
        decoder.decode_columns([good[0], good[1], unknown], FIELDS)
    assert "\n" not in str(exc.value)
    assert f"value 2 of 3 (schema id 987654) of topic {topic_name}" in str(exc.value)
    with pytest.raises(CorruptRecordError, match=f"value 1 of 2 of topic {topic_name} is not in the Confluent framing"):
        decoder.decode_columns([good[0], b'{"json": 1}'], FIELDS)
    with pytest.raises(CorruptRecordError, match="value 0 of 1 .schema id \\d+. .* cannot be decoded"):
        decoder.decode_columns([good[0][:-3]], FIELDS)


def test_a_registry_that_is_down_is_named_within_its_deadline(topic_name: str) -> None:
    settings = RegistryConfig(url=f"http://127.0.0.1:{free_port()}", deadline_s=1.0, request_timeout_s=0.5)
    decoder = confluent_decoder(settings, topic_name, "avro", reader="writer")
    with pytest.raises(SchemaRegistryError) as exc:
        decoder.decode_columns([b"\x00\x00\x00\x00\x07\x02"], ["x"])
    message = str(exc.value)
    assert "\n" not in message and "did not answer for schema id 7" in message and topic_name in message
    assert "registry.deadline_s=1s" in message


def test_a_slow_registry_is_retried_until_its_deadline(topic_name: str) -> None:
    """A registry that accepts connections but never answers: each request times out, kbit retries, then names it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        settings = RegistryConfig(
            url=f"http://127.0.0.1:{silent.getsockname()[1]}", deadline_s=1.5, request_timeout_s=0.4
        )
        decoder = confluent_decoder(settings, topic_name, "json", reader="writer")
        with pytest.raises(SchemaRegistryError) as exc:
            decoder.decode_columns([b"\x00\x00\x00\x00\x09{}"], ["x"])
    message = str(exc.value)
    assert "\n" not in message and "schema id 9" in message and "Timeout" in message
    assert int(message.split(" attempt(s)")[0].rsplit("(", 1)[1]) >= 2  # retried within the deadline

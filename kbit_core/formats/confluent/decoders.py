"""RecordDecoders (``kbit_core.formats.records``) for values in the Confluent wire format: Avro, JSON Schema and
Protobuf, each value's writer schema fetched by id from the Schema Registry (cached), every value resolved to one
reader schema (the subject's latest, one the user names by id, or each value's own writer schema)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import orjson
from confluent_kafka.schema_registry import Schema, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema
from google.protobuf.message_factory import GetMessageClass

from kbit_core.config.registry import RegistryConfig
from kbit_core.errors import ConfigError, CorruptRecordError, SchemaRegistryError
from kbit_core.formats.confluent.avro_decoder import AvroSchemaDecoder
from kbit_core.formats.confluent.columns import in_order, message_value
from kbit_core.formats.confluent.fields import avro_fields, json_schema_fields, protobuf_fields
from kbit_core.formats.confluent.framing import HEADER_BYTES, FramingError, message_indexes, schema_id
from kbit_core.formats.confluent.protobuf_decoder import indexed_message, registry_file
from kbit_core.formats.confluent.source import REGISTRY_FAILURES, SchemaSource, UnknownSchemaError
from kbit_core.formats.records import Column, WriterSchema, columns_of

ValueFormat = Literal["avro", "json", "protobuf"]
VALUE_FORMATS = ("avro", "json", "protobuf")
# The deserializers' subject is <topic>-value, named without asking the registry (confluent-kafka's default asks it
# for the topic's "associations", a call outside kbit's retries and deadline).
DESERIALIZER_CONF = {"subject.name.strategy": topic_subject_name_strategy}
# Each group of values of one writer schema decodes to {path: column}.
GroupDecoder = Callable[[Sequence[bytes], Sequence[str]], dict[str, Any]]


class ConfluentDecoder:
    """Values of one topic in the Confluent framing, decoded by their writer schemas into one reader schema's fields.

    ``reader``: ``"latest"`` (the subject's latest version, read once), a schema id, or ``"writer"`` (no
    resolution). ``decoder``: ``fast`` (kbit's Avro walker where it takes the schema) or ``stock``."""

    def __init__(
        self,
        source: SchemaSource,
        topic: str,
        value_format: ValueFormat,
        *,
        reader: str | int = "latest",
        subject: str | None = None,
        decoder: str = "fast",
    ) -> None:
        if value_format not in VALUE_FORMATS:
            raise ConfigError(f"the Confluent framing carries {', '.join(VALUE_FORMATS)}, not {value_format!r}")
        self.source, self.topic, self.format, self.decoder = source, topic, value_format, decoder
        self.subject = subject or f"{topic}-value"
        self.reader = reader
        self.context = SerializationContext(topic, MessageField.VALUE)
        self._reader: tuple[int, Schema] | None = None
        self._groups: dict[int, GroupDecoder] = {}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A decode worker process gets the settings and builds a registry client of its own (a client's connections
        # do not cross processes); its schema cache starts empty.
        options = {"reader": self.reader, "subject": self.subject, "decoder": self.decoder}
        return _rebuild, (self.source.settings, self.topic, self.format, options)

    def reader_schema(self) -> tuple[int, Schema] | None:
        """The id and schema every value is resolved to (None: each value's own writer schema)."""
        if self.reader == "writer":
            return None
        if self._reader is None:
            if self.reader == "latest":
                self._reader = self.source.latest(self.subject)
            else:
                self._reader = int(self.reader), self.source.schema(int(self.reader), self.topic)
        return self._reader

    def writer_schema(self) -> WriterSchema | None:
        """The reader schema's fields (the subject's latest when values are resolved to their own writer's)."""
        schema_id, schema = self.reader_schema() or self.source.latest(self.subject)
        if self.format == "avro":
            fields = avro_fields(parse_schema(json.loads(schema.schema_str)))
        elif self.format == "json":
            fields = json_schema_fields(json.loads(schema.schema_str))
        else:
            proto, pool = registry_file(schema, self.source.client)
            fields = protobuf_fields(indexed_message(proto, pool, [0]))
        source = f"registry {self.source.url} subject {self.subject} id {schema_id}"
        return WriterSchema(source, fields, subject=self.subject, schema_id=schema_id)

    def decode_columns(self, values: Sequence[bytes], fields: Sequence[str]) -> dict[str, Column]:
        ids = np.empty(len(values), dtype=np.int64)
        for position, value in enumerate(values):
            try:
                ids[position] = schema_id(value)
            except FramingError as exc:
                raise self._corrupt(position, len(values), None, exc) from None
        groups = []
        for sid in np.unique(ids).tolist():
            positions = np.flatnonzero(ids == sid)
            group = [values[i] for i in positions.tolist()]
            groups.append((positions, self._decode_group(sid, group, fields, positions, len(values))))
        return in_order(groups, fields, len(values))

    def _decode_group(
        self, sid: int, values: list[bytes], fields: Sequence[str], positions: np.ndarray, total: int
    ) -> dict[str, Any]:
        try:
            decode = self._group_decoder(sid)
        except UnknownSchemaError:
            raise self._corrupt(int(positions[0]), total, sid, "the Schema Registry does not hold it") from None
        except SchemaRegistryError as exc:  # the registry's fault, never the record's: not skippable as a bad record
            raise SchemaRegistryError(str(exc), schema_id=sid) from None
        try:
            return decode(values, fields)
        except REGISTRY_FAILURES as exc:
            raise SchemaRegistryError(
                f"the Schema Registry at {self.source.url} failed while topic {self.topic}'s values of schema id "
                f"{sid} were decoded: {type(exc).__name__}: {exc}",
                schema_id=sid,
            ) from None
        except Exception as exc:  # noqa: BLE001 - each library raises its own types for malformed input
            for position, value in zip(positions.tolist(), values):
                try:
                    decode([value], fields)
                except Exception as alone:  # noqa: BLE001
                    raise self._corrupt(position, total, sid, alone) from None
            raise self._corrupt(int(positions[0]), total, sid, exc) from None

    def _corrupt(self, position: int, total: int, sid: int | None, reason: object) -> CorruptRecordError:
        which = "" if sid is None else f" (schema id {sid})"
        problem = f"is not in the Confluent framing: {reason}" if sid is None else f"cannot be decoded: {reason}"
        return CorruptRecordError(
            f"{self.format} value {position} of {total}{which} of topic {self.topic} {problem}", topic=self.topic
        )

    def _group_decoder(self, sid: int) -> GroupDecoder:
        if sid not in self._groups:
            writer = self.source.schema(sid, self.topic)
            build = {"avro": self._avro, "json": self._json, "protobuf": self._protobuf}[self.format]
            self._groups[sid] = build(sid, writer)
        return self._groups[sid]

    def _avro(self, sid: int, writer: Schema) -> GroupDecoder:
        reader = self.reader_schema()
        stock = AvroDeserializer(self.source.client, reader[1] if reader is not None else None, conf=DESERIALIZER_CONF)
        parsed_reader = parse_schema(json.loads(reader[1].schema_str)) if reader is not None else None
        decoder = AvroSchemaDecoder(
            parse_schema(json.loads(writer.schema_str)),
            parsed_reader if reader is not None and reader[0] != sid else None,
            lambda value: stock(value, self.context),
            f"topic {self.topic} schema id {sid}",
            fast=self.decoder == "fast" and not writer.references,
        )
        return lambda values, fields: decoder.columns(values, fields, HEADER_BYTES)

    def _json(self, sid: int, writer: Schema) -> GroupDecoder:
        if self.decoder == "stock":
            stock = JSONDeserializer(None, schema_registry_client=self.source.client, conf=DESERIALIZER_CONF)
            parse: Callable[[bytes], Any] = lambda value: stock(value, self.context)  # noqa: E731
        else:
            parse = lambda value: orjson.loads(memoryview(value)[HEADER_BYTES:])  # noqa: E731
        return lambda values, fields: columns_of([parse(v) for v in values], fields)

    def _protobuf(self, sid: int, writer: Schema) -> GroupDecoder:
        proto, pool = registry_file(writer, self.source.client)
        classes: dict[tuple[int, ...], Any] = {}

        def parse(value: bytes) -> Any:
            indexes, start = message_indexes(value)
            key = tuple(indexes)
            if key not in classes:
                classes[key] = GetMessageClass(indexed_message(proto, pool, indexes))
            return classes[key].FromString(value[start:])

        return lambda values, fields: _messages([parse(v) for v in values], fields)


def _messages(messages: list[Any], fields: Sequence[str]) -> dict[str, Any]:
    return {path: [message_value(message, path) for message in messages] for path in fields}


def confluent_decoder(
    registry: RegistryConfig, topic: str, value_format: ValueFormat, **options: Any
) -> ConfluentDecoder:
    """The RecordDecoder of ``topic``'s values in the Confluent framing (``value_format``: avro, json or protobuf),
    writer schemas from the registry ``registry`` names; ``options`` are :class:`ConfluentDecoder`'s keywords
    (``reader``, ``subject``, ``decoder``)."""
    if not registry.enabled:
        raise ConfigError(
            f"topic {topic}'s values are in the Confluent framing: set registry.url (or registry.local.enabled)"
        )
    return ConfluentDecoder(SchemaSource(registry), topic, value_format, **options)


def _rebuild(
    settings: RegistryConfig, topic: str, value_format: ValueFormat, options: dict[str, Any]
) -> ConfluentDecoder:
    return ConfluentDecoder(SchemaSource(settings), topic, value_format, **options)

"""RecordDecoders for values without a registry: schemaless Avro binary written with a schema file (optionally
resolved to a reader schema file), and plain Protobuf messages of a FileDescriptorSet file's message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import SchemaParseException

from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats.confluent.avro_decoder import AvroSchemaDecoder, schemaless_stock
from kbit_core.formats.confluent.columns import message_value
from kbit_core.formats.confluent.fields import avro_fields, protobuf_fields
from kbit_core.formats.confluent.protobuf_decoder import descriptor_set_message
from kbit_core.formats.records import Column, WriterSchema


def read_avro_schema(path: Path) -> dict[str, Any]:
    """An .avsc file parsed by fastavro; a file that is not one is named in one line."""
    try:
        return parse_schema(json.loads(Path(path).read_text()))
    except (OSError, ValueError, SchemaParseException) as exc:
        raise ConfigError(f"Avro schema file {path} cannot be read as an Avro schema ({exc})") from None


def _localised(decode: Any, values: Sequence[bytes], fields: Sequence[str], what: str) -> dict[str, Any]:
    """``decode(values, fields)``, or CorruptRecordError naming the first value that fails on its own."""
    try:
        return decode(values, fields)
    except Exception as exc:  # noqa: BLE001 - each library raises its own types for malformed input
        for position, value in enumerate(values):
            try:
                decode([value], fields)
            except Exception as alone:  # noqa: BLE001
                raise CorruptRecordError(
                    f"{what} value {position} of {len(values)} cannot be decoded: {alone}"
                ) from None
        raise CorruptRecordError(f"{what}: cannot decode {len(values)} values: {exc}") from None


class AvroFileDecoder:
    """Schemaless Avro values written with one schema file, resolved to a reader schema file when one is given."""

    def __init__(self, schema_path: Path, reader_path: Path | None = None, decoder: str = "fast") -> None:
        self.schema_path, self.reader_path = Path(schema_path), reader_path
        writer = read_avro_schema(self.schema_path)
        self.reader = read_avro_schema(reader_path) if reader_path is not None else None
        self._decoder = AvroSchemaDecoder(
            writer, self.reader, schemaless_stock(writer, self.reader), f"schema file {schema_path}", decoder == "fast"
        )

    def writer_schema(self) -> WriterSchema:
        schema = self.reader or self._decoder.writer
        return WriterSchema(f"schema file {self.reader_path or self.schema_path}", avro_fields(schema))

    def decode_columns(self, values: Sequence[bytes], fields: Sequence[str]) -> dict[str, Column]:
        decode = lambda vs, fs: self._decoder.columns(vs, fs, 0)  # noqa: E731
        return _localised(decode, values, fields, f"Avro (schema file {self.schema_path.name})")


class ProtobufFileDecoder:
    """Plain Protobuf messages (no framing) of ``message`` in the FileDescriptorSet file ``descriptor_set``."""

    def __init__(self, descriptor_set: Path, message: str) -> None:
        self.descriptor_set, self.message = Path(descriptor_set), message
        self.message_class = descriptor_set_message(self.descriptor_set, message)

    def writer_schema(self) -> WriterSchema:
        return WriterSchema(
            f"descriptor set {self.descriptor_set} message {self.message}",
            protobuf_fields(self.message_class.DESCRIPTOR),
        )

    def decode_columns(self, values: Sequence[bytes], fields: Sequence[str]) -> dict[str, Column]:
        def decode(vs: Sequence[bytes], fs: Sequence[str]) -> dict[str, Any]:
            messages = [self.message_class.FromString(v) for v in vs]
            return {path: [message_value(m, path) for m in messages] for path in fs}

        return _localised(decode, values, fields, f"Protobuf {self.message}")


def avro_file_decoder(
    schema_path: Path, reader_schema_path: Path | None = None, decoder: str = "fast"
) -> AvroFileDecoder:
    """The RecordDecoder of schemaless Avro values written with the .avsc ``schema_path``."""
    return AvroFileDecoder(Path(schema_path), reader_schema_path, decoder)


def protobuf_descriptor_decoder(descriptor_set: Path, message: str) -> ProtobufFileDecoder:
    """The RecordDecoder of plain Protobuf values of ``message`` (full name) in the FileDescriptorSet file."""
    return ProtobufFileDecoder(Path(descriptor_set), message)

"""Protobuf message classes for decoding: from a Schema Registry's writer schema (a serialized FileDescriptorProto,
its references fetched too) and the message indexes of a Confluent-framed value, or from a FileDescriptorSet file
and a message name."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry._sync.protobuf import _resolve_named_schema
from confluent_kafka.schema_registry.common.protobuf import _init_pool
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass

from kbit_core.errors import ConfigError


def registry_file(schema: Schema, client: Any) -> tuple[descriptor_pb2.FileDescriptorProto, DescriptorPool]:
    """A registry's Protobuf schema as a file in a pool of its own, with the files it references (fetched)."""
    try:
        proto = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(schema.schema_str, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"the registry returned a Protobuf schema kbit cannot read ({exc}): kbit reads the serialized form "
            "(base64 FileDescriptorProto, what confluent-kafka's ProtobufSerializer registers), not .proto text"
        ) from None
    pool = DescriptorPool()
    _init_pool(pool)
    _resolve_named_schema(schema, client, pool)
    proto.name = proto.name or "default"
    pool.Add(proto)
    return proto, pool


def indexed_message(proto: descriptor_pb2.FileDescriptorProto, pool: DescriptorPool, indexes: list[int]) -> Descriptor:
    """The message the Confluent message indexes name: the file's message ``indexes[0]``, then nested ones."""
    names, messages = [], list(proto.message_type)
    for index in indexes:
        if not 0 <= index < len(messages):
            raise ValueError(f"message index {index} is out of range ({len(messages)} message(s) there)")
        names.append(messages[index].name)
        messages = list(messages[index].nested_type)
    package = f"{proto.package}." if proto.package else ""
    return pool.FindMessageTypeByName(package + ".".join(names))


def descriptor_set_message(path: Path, message: str) -> Any:
    """The message class ``message`` (its full name) of a FileDescriptorSet file (``protoc --descriptor_set_out``,
    with ``--include_imports`` when it imports other files)."""
    try:
        files = descriptor_pb2.FileDescriptorSet.FromString(Path(path).read_bytes()).file
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Protobuf descriptor set {path} cannot be read as a FileDescriptorSet ({exc})") from None
    pool = DescriptorPool()
    try:
        for proto in files:
            pool.Add(proto)
        return GetMessageClass(pool.FindMessageTypeByName(message))
    except (KeyError, TypeError) as exc:
        known = sorted(f"{p.package + '.' if p.package else ''}{m.name}" for p in files for m in p.message_type)
        raise ConfigError(
            f"Protobuf descriptor set {path} has no message {message!r} ({exc}); its messages: {known}"
        ) from None

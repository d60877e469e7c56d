"""The contract between a decoder of message values kbit did not write and the mapping that makes tensors of them:
named fields of a block of values, as columns, and the writer schema those fields are checked against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# The kinds a field of a user's record can have, as the mapping checks them (Avro, Protobuf and JSON Schema types
# map onto these; "array<...>" holds the element kind).
FIELD_KINDS = (
    "bytes",
    "string",
    "int",
    "float",
    "bool",
    "record",
    "array<int>",
    "array<float>",
    "array<string>",
    "array<record>",
)


@dataclass(frozen=True)
class FieldType:
    """One field of a writer schema: its dotted path from the record's root, its kind, and whether it may be null."""

    path: str
    kind: str
    nullable: bool = False


@dataclass(frozen=True)
class WriterSchema:
    """The schema records were written with, as a mapping is checked against it before any rank starts.

    ``subject`` and ``schema_id`` name it in a Schema Registry (both None for a schema file); ``source`` says where it
    came from in words (``"registry http://127.0.0.1:8081 subject t-value id 3"``, ``"schema file x.avsc"``)."""

    source: str
    fields: dict[str, FieldType] = field(default_factory=dict)
    subject: str | None = None
    schema_id: int | None = None


# A decoded column: a list of Python values (bytes, int, float, str, bool, list, dict or None), or a numpy array
# when a decoder fills one directly (a fast path).
Column = list[Any] | np.ndarray


class RecordDecoder(Protocol):
    """Turns a block of one topic's message values into the fields a mapping asks for."""

    def writer_schema(self) -> WriterSchema | None:
        """The schema the mapping is checked against at preflight; None for schemaless values (plain JSON)."""
        ...

    def decode_columns(self, values: Sequence[bytes], fields: Sequence[str]) -> dict[str, Column]:
        """Every requested field (dotted path) of every value, one column per field, in the values' order.

        All or nothing: a value that cannot be decoded (wrong framing, unknown schema id, malformed payload) raises
        ``CorruptRecordError`` in one line; the caller localises the culprits value by value and names topic,
        partition and offset. A field a record lacks is None in its column."""
        ...


def field_at(record: Any, path: str) -> Any:
    """The value at the dotted ``path`` of a decoded record (nested dicts); None where the path ends early or meets
    something that is not a dict."""
    for name in path.split("."):
        if not isinstance(record, dict):
            return None
        record = record.get(name)
    return record


def columns_of(records: Sequence[Any], fields: Sequence[str]) -> dict[str, list[Any]]:
    """Every dotted field of every decoded record, one column per field, in the records' order."""
    return {path: [field_at(record, path) for record in records] for path in fields}

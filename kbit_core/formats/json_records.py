"""Schemaless JSON message values (orjson) as the columns a mapping asks for: fields found by dotted path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats.records import Column, WriterSchema, columns_of


class JsonRecordDecoder:
    """A :class:`~kbit_core.formats.records.RecordDecoder` for plain JSON objects: no schema to check against (the
    mapping checks the first records instead)."""

    def __init__(self, decoder: str = "fast", **options: Any) -> None:
        if options:
            raise ConfigError(f"source.value_options: value format 'json' takes none, got {sorted(options)}")

    def writer_schema(self) -> WriterSchema | None:
        return None

    def decode_columns(self, values: Sequence[bytes], fields: Sequence[str]) -> dict[str, Column]:
        try:
            documents = list(map(orjson.loads, values))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise CorruptRecordError(f"a value is not JSON: {exc}") from None
        return columns_of(documents, fields)

"""The fields a mapping takes from a message besides its value: ``@key``, ``@timestamp`` and ``@header.NAME``, read
from the records the consumer carried them in (only when a mapping names one: kbit's own topics never pay for them).

Null handling: a message without a key, without the named header (or with a null header value), or whose timestamp
is unavailable (-1) gives None, which the mapping treats as any null field (``source.mapping.nulls`` for features; a
null label is an error). A header that repeats gives its last value, as Kafka's ``Headers.lastHeader``. Bytes that do
not read as the configured format (not UTF-8, not a decimal integer, not 4 or 8 bytes) make the record a bad record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kbit_core.config import MappingConfig
from kbit_core.config.topics import HEADER_FIELD, KEY_FIELD, TIMESTAMP_FIELD, KeyFormat, is_message_field

# The kind (formats.records.FIELD_KINDS) each format of key or header bytes gives.
_KINDS: dict[str, str] = {"bytes": "bytes", "string": "string", "int": "int", "int32": "int", "int64": "int"}
_FIXED_SIZES = {"int32": 4, "int64": 8}  # Kafka's IntegerSerializer and LongSerializer: big-endian two's complement


def message_fields(mapping: MappingConfig) -> list[str]:
    """The mapped paths that name a message's key, header or timestamp, in the mapping's order."""
    return [path for path in (*mapping.features, mapping.label) if is_message_field(path)]


def message_field_kind(path: str, mapping: MappingConfig) -> str:
    """The kind of value ``path`` gives: int for the timestamp, the configured format's kind for key and headers."""
    if path == TIMESTAMP_FIELD:
        return "int"
    return _KINDS[mapping.key_format if path == KEY_FIELD else mapping.header_format]


def message_columns(records: Sequence[Any], paths: Sequence[str], mapping: MappingConfig) -> dict[str, list[Any]]:
    """One column per message field in ``paths`` for ``records`` (carrying key, headers and timestamp), in order.

    Raises ValueError naming the field when a key or header does not read as its format."""
    columns: dict[str, list[Any]] = {}
    for path in paths:
        if path == TIMESTAMP_FIELD:
            columns[path] = [None if r.timestamp is None or r.timestamp < 0 else r.timestamp for r in records]
        elif path == KEY_FIELD:
            columns[path] = [_parsed(r.key, mapping.key_format, path) for r in records]
        else:
            name = path[len(HEADER_FIELD) :]
            columns[path] = [_parsed(_last_header(r.headers, name), mapping.header_format, path) for r in records]
    return columns


def _last_header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return found


def _parsed(raw: bytes | None, fmt: KeyFormat, path: str) -> Any:
    if raw is None or fmt == "bytes":
        return raw
    if fmt == "string" or fmt == "int":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"field {path!r} is not UTF-8 text ({len(raw)} bytes)") from None
        if fmt == "string":
            return text
        if not text.strip().lstrip("+-").isdigit():
            raise ValueError(f"field {path!r} holds {text[:40]!r}, not a decimal integer")
        return int(text)
    if len(raw) != _FIXED_SIZES[fmt]:
        raise ValueError(f"field {path!r} holds {len(raw)} bytes, {fmt} needs {_FIXED_SIZES[fmt]}")
    return int.from_bytes(raw, "big", signed=True)

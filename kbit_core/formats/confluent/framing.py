"""The Confluent wire format around a message value: magic byte 0, the writer schema's id as 4 bytes big-endian,
then the payload (Avro binary, JSON text, or, for Protobuf, the message indexes as zigzag varints and the message)."""

from __future__ import annotations

MAGIC = 0
HEADER_BYTES = 5


class FramingError(ValueError):
    """A value that is not in the Confluent framing (too short, another magic byte, bad message indexes)."""


def schema_id(value: bytes | None) -> int:
    """The writer schema id in ``value``'s header."""
    if value is None:
        raise FramingError("a null value (tombstone) has no Confluent framing")
    if len(value) < HEADER_BYTES:
        raise FramingError(f"a {len(value)}-byte value is too short for the Confluent framing (5-byte header)")
    if value[0] != MAGIC:
        raise FramingError(f"value starts with byte 0x{value[0]:02x}, not the Confluent framing's magic byte 0x00")
    return int.from_bytes(value[1:HEADER_BYTES], "big")


def frame(schema_id: int, payload: bytes) -> bytes:
    """``payload`` in the Confluent framing for writer schema ``schema_id``."""
    return bytes([MAGIC]) + schema_id.to_bytes(4, "big") + payload


def _zigzag_varint(value: bytes, pos: int) -> tuple[int, int]:
    raw, shift = 0, 0
    while True:
        if pos >= len(value):
            raise FramingError("the Protobuf message indexes run past the value")
        byte = value[pos]
        raw |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7
        if shift > 63:
            raise FramingError("a Protobuf message index varint is longer than 10 bytes")


def message_indexes(value: bytes, pos: int = HEADER_BYTES) -> tuple[list[int], int]:
    """The Protobuf message indexes at ``pos`` (a count, then the indexes; a count of 0 means ``[0]``, the file's
    first message) and where the message starts."""
    count, pos = _zigzag_varint(value, pos)
    if count == 0:
        return [0], pos
    if count < 0 or count > 128:
        raise FramingError(f"Protobuf message index count {count} is not a plausible nesting depth")
    indexes = []
    for _ in range(count):
        index, pos = _zigzag_varint(value, pos)
        if index < 0:
            raise FramingError(f"negative Protobuf message index {index}")
        indexes.append(index)
    return indexes, pos

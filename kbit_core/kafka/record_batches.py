"""Kafka's v2 record batches, as a Fetch response carries them, parsed into columns with numpy: each record's offset
and where its key and value lie in one buffer, with no Python object per record.

A batch (KIP-98's format, the only one Apache Kafka 4 writes)::

    baseOffset i64, batchLength i32, partitionLeaderEpoch i32, magic i8 (2), crc u32, attributes i16,
    lastOffsetDelta i32, baseTimestamp i64, maxTimestamp i64, producerId i64, producerEpoch i16,
    baseSequence i32, recordCount i32, records...                                              (61-byte header)
    record: length varint, attributes i8, timestampDelta varlong, offsetDelta varint,
            keyLength varint, key, valueLength varint, value, headerCount varint, headers

Every varint is zigzag-encoded. Records are located by their length prefixes: a run of records of one length is
checked in a single numpy step (each predicted start must hold that length), so a batch of equal-sized records
costs a few array operations whatever its record count.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
LENGTH_PREFIX = 12  # baseOffset and batchLength: batchLength counts the bytes after them
COMPRESSION_MASK = 0x07
TRANSACTIONAL = 0x10
CONTROL = 0x20
CONTROL_ABORT = 0

_MAX_VARINT, _MAX_VARLONG = 5, 10


class RecordBatchError(ValueError):
    """A fetched batch that is not a well-formed v2 record batch; the message names the batch's base offset."""


@dataclass(frozen=True)
class BatchHeader:
    base_offset: int
    end: int  # position just past the batch in its buffer
    magic: int
    attributes: int
    last_offset_delta: int
    producer_id: int
    record_count: int

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def compression(self) -> int:
        return self.attributes & COMPRESSION_MASK

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL)


def batch_headers(buf: bytes) -> Iterator[tuple[int, BatchHeader]]:
    """``(start, header)`` of each complete batch in ``buf``; a partial batch at the end (the broker cuts a response
    at its byte limit) is left out, as every client does."""
    pos, size = 0, len(buf)
    while pos + LENGTH_PREFIX <= size:
        base, length = struct.unpack_from(">qi", buf, pos)
        end = pos + LENGTH_PREFIX + length
        if end > size:
            return
        if end < pos + HEADER_SIZE:
            raise RecordBatchError(f"record batch at offset {base} is {length + LENGTH_PREFIX} bytes, under its header")
        (_, _, _, magic, _, attributes, last_delta, _, _, producer_id, _, _, count) = HEADER.unpack_from(buf, pos)
        if magic != 2:
            raise RecordBatchError(f"record batch at offset {base} has message format v{magic}; only v2 is read")
        yield pos, BatchHeader(base, end, magic, attributes, last_delta, producer_id, count)
        pos = end


def varints_at(data: np.ndarray, positions: np.ndarray, width: int = _MAX_VARINT) -> tuple[np.ndarray, np.ndarray]:
    """The zigzag varints starting at ``positions`` of ``data`` (uint8): (values, byte lengths). A length of 0 marks
    bytes that are no varint of at most ``width`` bytes. Byte k is read only for the varints still going on at k
    (most are one or two bytes long), so a valid varint is never read past its end."""
    encoded = data[positions].astype(np.int64)
    lengths = np.ones(len(positions), np.int64)
    going = np.flatnonzero(encoded >= 0x80)
    encoded &= 0x7F
    for k in range(1, width):
        if not going.size:
            break
        more = data[positions[going] + k].astype(np.int64)
        encoded[going] |= (more & 0x7F) << (7 * k)
        lengths[going] += 1
        going = going[more >= 0x80]
    lengths[going] = 0
    return (encoded >> 1) ^ -(encoded & 1), lengths


def _checked(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not lengths.all():
        raise RecordBatchError("a varint runs past its longest encoding")
    return values, lengths


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    encoded = shift = 0
    for n in range(_MAX_VARINT):
        byte = buf[pos + n]
        encoded |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (encoded >> 1) ^ -(encoded & 1), n + 1
        shift += 7
    raise RecordBatchError(f"a varint longer than {_MAX_VARINT} bytes at byte {pos}")


SHORT_RUN = 8  # a guessed run shorter than this: records of varying sizes, walked one by one for a while
WALK = 64


def record_starts(buf: bytes, data: np.ndarray, first: int, end: int, count: int) -> np.ndarray:
    """Start positions of the ``count`` records laid out from ``first`` to ``end`` in ``buf`` (``data``: the same
    bytes as a padded uint8 array).

    Each record's length prefix gives the next start. A run is guessed from the current record's size and checked in
    one step: the first predicted start whose prefix disagrees is still a true start (the record before it had the
    guessed size), so the walk goes on from there. Records of varying sizes (short runs) are walked one by one.
    """
    starts = np.empty(count, np.int64)
    done, pos = 0, first
    while done < count:
        length, prefix = _varint(buf, pos)
        size = prefix + length
        if length <= 0 or pos + size > end:
            raise RecordBatchError(f"record {done} of {count} at byte {pos} has length {length}, past its batch")
        run = min(count - done, (end - pos) // size)
        guess = pos + size * np.arange(run, dtype=np.int64)
        # a record of this size starts with these prefix bytes (writers encode varints canonically; any other
        # encoding only ends the run here, and the walk below reads it)
        agree = data[guess] == buf[pos]
        for k in range(1, prefix):
            agree &= data[guess + k] == buf[pos + k]
        good = run if agree.all() else int(np.argmin(agree))
        starts[done : done + good] = guess[:good]
        done, pos = done + good, pos + good * size
        if good < SHORT_RUN:
            done, pos = _walk(buf, starts, done, pos, end, min(count, done + WALK))
    if pos != end:
        raise RecordBatchError(f"{count} records end at byte {pos}, not at their batch's end {end}")
    return starts


def _walk(buf: bytes, starts: np.ndarray, done: int, pos: int, end: int, until: int) -> tuple[int, int]:
    for i in range(done, until):
        first = buf[pos]
        if first < 0x80:  # lengths of one and two bytes read inline: a call per record doubled the walk's cost
            length, prefix = (first >> 1) ^ -(first & 1), 1
        elif (second := buf[pos + 1]) < 0x80:
            encoded = (first & 0x7F) | second << 7
            length, prefix = (encoded >> 1) ^ -(encoded & 1), 2
        else:
            length, prefix = _varint(buf, pos)
        if length <= 0 or pos + prefix + length > end:
            raise RecordBatchError(f"record {i} at byte {pos} has length {length}, past its batch")
        starts[i] = pos
        pos += prefix + length
    return until, pos


@dataclass
class RecordFields:
    """Columns of the records of some batches, positions into one buffer (``lengths`` -1: null)."""

    offsets: np.ndarray
    timestamps: np.ndarray
    key_starts: np.ndarray
    key_lengths: np.ndarray
    value_starts: np.ndarray
    value_lengths: np.ndarray
    header_counts: np.ndarray
    header_starts: np.ndarray
    record_starts: np.ndarray  # where each record (its length prefix) starts, and where it ends
    record_ends: np.ndarray


def record_fields(
    data: np.ndarray, starts: np.ndarray, base_offset: int | np.ndarray, base_timestamp: int | np.ndarray
) -> RecordFields:
    """Every field of the records at ``starts`` (see :func:`record_starts`), decoded column by column; the bases are
    their batches' (one, or one per record)."""
    lengths, prefix = _checked(*varints_at(data, starts))
    at = starts + prefix + 1  # past the length and the record's attributes byte
    timestamp_delta, n = _checked(*varints_at(data, at, _MAX_VARLONG))
    at += n
    offset_delta, n = _checked(*varints_at(data, at))
    at += n
    key_lengths, n = _checked(*varints_at(data, at))
    key_starts = at + n
    at = key_starts + np.maximum(key_lengths, 0)
    value_lengths, n = _checked(*varints_at(data, at))
    value_starts = at + n
    at = value_starts + np.maximum(value_lengths, 0)
    header_counts, n = _checked(*varints_at(data, at))
    return RecordFields(
        offsets=base_offset + offset_delta,
        timestamps=base_timestamp + timestamp_delta,
        key_starts=key_starts,
        key_lengths=key_lengths,
        value_starts=value_starts,
        value_lengths=value_lengths,
        header_counts=header_counts,
        header_starts=at + n,
        record_starts=starts,
        record_ends=starts + prefix + lengths,
    )


def read_headers(data: bytes, start: int, count: int) -> list[tuple[str, bytes | None]]:
    """One record's headers (only asked for by a codec that reads them)."""
    headers, pos = [], start
    for _ in range(count):
        key_length, n = _varint(data, pos)
        key = data[pos + n : pos + n + key_length].decode("utf-8")
        pos += n + key_length
        value_length, n = _varint(data, pos)
        pos += n
        headers.append((key, None if value_length < 0 else data[pos : pos + value_length]))
        pos += max(value_length, 0)
    return headers


Decompress = Callable[[int, bytes], bytes]


@dataclass
class ParsedBatches:
    """What one partition's fetched bytes hold: the records' columns over ``buffer``, and how far they reach."""

    buffer: bytes
    fields: RecordFields
    next_offset: int  # past the last complete batch (records, control batches and aborted ones alike)


def parse_batches(
    buf: bytes, decompress: Decompress, aborted: Sequence[tuple[int, int]] = (), *, from_offset: int = 0
) -> ParsedBatches:
    """Parse every complete batch of ``buf``: records below ``from_offset`` (a batch's head before the fetch offset),
    control batches and the batches of ``aborted`` transactions (``(producer id, first offset)`` pairs, a
    read_committed Fetch's answer) are left out. Records are located in ``buf`` itself when no batch is compressed;
    otherwise every kept batch's records are decompressed or copied into one new buffer."""
    kept, next_offset = _kept_batches(buf, aborted, from_offset)
    if any(header.compression for _, header in kept):
        pieces = [_records_of(buf, start, header, decompress) for start, header in kept]
        buffer, firsts = b"".join(pieces), np.cumsum([0, *map(len, pieces)])
        spans = [(int(a), int(b)) for a, b in zip(firsts[:-1], firsts[1:])]
    else:
        buffer, spans = buf, [(start + HEADER_SIZE, header.end) for start, header in kept]
    data = np.frombuffer(buffer, np.uint8)
    counted = [(header, span) for (start, header), span in zip(kept, spans) if header.record_count]
    if not counted:
        return ParsedBatches(buffer, _empty_fields(), next_offset)
    try:
        starts = np.concatenate([record_starts(buffer, data, a, b, h.record_count) for h, (a, b) in counted])
        counts = [h.record_count for h, _ in counted]
        base_offsets = np.repeat([h.base_offset for h, _ in counted], counts)
        timestamps = np.repeat([_base_timestamp(buf, start) for start, h in kept if h.record_count], counts)
        fields = record_fields(data, starts, base_offsets, timestamps)
        _check_records(fields, np.repeat([h.last_offset for h, _ in counted], counts))
    except (RecordBatchError, IndexError) as exc:
        raise RecordBatchError(f"record batches from offset {counted[0][0].base_offset} do not parse: {exc}") from None
    keep = fields.offsets >= from_offset
    if not keep.all():
        fields = RecordFields(*(column[keep] for column in vars(fields).values()))
    return ParsedBatches(buffer, fields, next_offset)


def _kept_batches(
    buf: bytes, aborted: Sequence[tuple[int, int]], from_offset: int
) -> tuple[list[tuple[int, BatchHeader]], int]:
    """The batches of ``buf`` that hold records to deliver, and the offset past the last complete batch."""
    pending = sorted(aborted, key=lambda a: a[1])
    aborting: set[int] = set()
    kept, next_offset = [], from_offset
    for start, header in batch_headers(buf):
        next_offset = max(next_offset, header.last_offset + 1)
        while pending and pending[0][1] <= header.last_offset:
            aborting.add(pending.pop(0)[0])
        if header.is_control:
            if _control_type(buf, start, header) == CONTROL_ABORT:
                aborting.discard(header.producer_id)
        elif not (header.is_transactional and header.producer_id in aborting or header.last_offset < from_offset):
            kept.append((start, header))
    return kept, next_offset


def _records_of(buf: bytes, start: int, header: BatchHeader, decompress: Decompress) -> bytes | memoryview:
    records = memoryview(buf)[start + HEADER_SIZE : header.end]
    return decompress(header.compression, bytes(records)) if header.compression else records


def _base_timestamp(buf: bytes, start: int) -> int:
    return struct.unpack_from(">q", buf, start + 27)[0]


def _check_records(fields: RecordFields, last_offsets: np.ndarray) -> None:
    """Offsets rising and inside their batches, and each record's fields inside its length."""
    offsets = fields.offsets
    if np.any(np.diff(offsets) <= 0) or np.any(offsets > last_offsets):
        raise RecordBatchError("record offsets out of order or outside their batch")
    value_ends = fields.value_starts + np.maximum(fields.value_lengths, 0)
    if np.any(fields.header_starts > fields.record_ends) or np.any(value_ends > fields.record_ends):
        raise RecordBatchError("a record's fields overrun its length")


def _control_type(buf: bytes, start: int, header: BatchHeader) -> int:
    """A control batch's marker type (0 abort, 1 commit), from its one record's key (version i16, type i16)."""
    records = buf[start + HEADER_SIZE : header.end]
    data = np.frombuffer(records, np.uint8)
    fields = record_fields(data, np.zeros(1, np.int64), header.base_offset, 0)
    (_, marker) = struct.unpack_from(">hh", records, int(fields.key_starts[0]))
    return marker


def _empty_fields() -> RecordFields:
    empty = np.empty(0, np.int64)
    return RecordFields(*(empty for _ in range(10)))

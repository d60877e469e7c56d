"""kbit's record-batch parser against batches written by another implementation (kafka-python's builder) and read
back by it: offsets, keys, values, headers and timestamps agree for every compression, layout and size mix; partial,
control, aborted and malformed batches are handled as a consumer must."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.memory_records import MemoryRecords

from kbit_core.kafka.batch_consumer import decompress
from kbit_core.kafka.record_batches import RecordBatchError, parse_batches, varints_at
from kbit_core.kafka.record_columns import RecordColumns

T0 = 1_700_000_000_000
CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def build(records, *, base=0, codec=0, producer_id=-1, transactional=False, control=False, step_ms=7) -> bytes:
    """One v2 batch of ``records`` ((key, value, headers) each) at ``base``, written by kafka-python."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=codec,
        is_transactional=transactional,
        producer_id=producer_id,
        producer_epoch=0 if producer_id >= 0 else -1,
        base_sequence=0 if producer_id >= 0 else -1,
        batch_size=1 << 30,
    )
    for i, (key, value, headers) in enumerate(records):
        builder.append(i, T0 + i * step_ms, key, value, headers)
    buf = bytearray(builder.build())
    struct.pack_into(">q", buf, 0, base)  # baseOffset lies outside the CRC
    if control:
        (attributes,) = struct.unpack_from(">h", buf, 21)
        struct.pack_into(">h", buf, 21, attributes | 0x20)
    return bytes(buf)


def oracle(buf: bytes) -> list[tuple]:
    """What kafka-python's own reader finds in ``buf``: (offset, timestamp, key, value, headers) per record."""
    out, records = [], MemoryRecords(buf)
    while (batch := records.next_batch()) is not None:
        out += [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in batch]
    return out


def columns(buf: bytes, partition: int = 0, **kwargs) -> RecordColumns:
    result = parse_batches(buf, decompress, **kwargs)
    return RecordColumns(partition, result.buffer, result.fields, metadata=True)


def parsed(buf: bytes, **kwargs) -> list[tuple]:
    return [(r.offset, r.timestamp, r.key, r.value, r.headers or []) for r in columns(buf, **kwargs)]


def fixed(n: int, size: int = 808, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(None, rng.integers(0, 256, size, dtype=np.uint8).tobytes(), []) for _ in range(n)]


def mixed(n: int, seed: int = 1) -> list[tuple]:
    """Keys, nulls, headers and values of every length, as user topics hold."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = None if i % 3 else f"k{i}".encode()
        value = None if i % 17 == 5 else bytes(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))
        headers = [("h", b"x" * (i % 4)), ("empty", None)] if i % 5 == 0 else []
        out.append((key, value, headers))
    return out


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("records", [fixed(300), mixed(300), fixed(2, size=0)], ids=["fixed", "mixed", "empty-values"])
def test_every_record_reads_as_the_writers_own_reader_reads_it(codec, records):
    buf = build(records[:150], base=1000, codec=CODECS[codec]) + build(records[150:], base=1150, codec=CODECS[codec])
    assert parsed(buf) == oracle(buf)
    assert [r[0] for r in parsed(buf)] == list(range(1000, 1000 + len(records)))


def test_fixed_size_values_come_out_as_one_matrix_viewing_the_fetched_bytes():
    records = fixed(1000, size=100)
    buf = build(records[:600]) + build(records[600:], base=600)
    values = columns(buf).values
    matrix = values.matrix()
    assert matrix.shape == (1000, 100)
    assert np.array_equal(matrix, np.frombuffer(b"".join(v for _, v, _ in records), np.uint8).reshape(1000, 100))
    assert values.joined() == b"".join(v for _, v, _ in records)


def test_values_of_many_lengths_have_no_matrix_but_join_and_index_alike():
    records = [(None, v, []) for _, v, _ in mixed(200) if v is not None]
    buf = build(records)
    column = columns(buf).values
    assert column.matrix() is None
    assert column.joined() == b"".join(v for _, v, _ in records)
    assert list(column[10:20]) == [v for _, v, _ in records[10:20]]
    assert list(column[np.array([3, 1])]) == [records[3][1], records[1][1]]


def test_a_batch_cut_off_at_the_end_of_the_response_is_left_for_the_next_fetch():
    whole, cut = build(fixed(50)), build(fixed(50, seed=2), base=50)
    result = parse_batches(whole + cut[:-100], decompress)
    assert result.fields.offsets.tolist() == list(range(50))
    assert result.next_offset == 50


def test_records_before_the_fetch_offset_are_left_out_but_the_position_moves_past_the_batch():
    buf = build(fixed(100), base=0)
    result = parse_batches(buf, decompress, from_offset=37)
    assert result.fields.offsets.tolist() == list(range(37, 100))
    assert result.next_offset == 100


def test_control_batches_and_aborted_transactions_are_skipped_committed_ones_kept():
    aborted = build(fixed(10), base=0, producer_id=7, transactional=True)
    abort_marker = build([(struct.pack(">hh", 0, 0), b"\0" * 6, [])], base=10, producer_id=7, control=True)
    committed = build(fixed(10, seed=3), base=11, producer_id=8, transactional=True)
    commit_marker = build([(struct.pack(">hh", 0, 1), b"\0" * 6, [])], base=21, producer_id=8, control=True)
    plain = build(fixed(5, seed=4), base=22)
    result = parse_batches(aborted + abort_marker + committed + commit_marker + plain, decompress, [(7, 0)])
    assert result.fields.offsets.tolist() == [*range(11, 21), *range(22, 27)]
    assert result.next_offset == 27


def test_a_producer_aborting_after_the_fetch_window_keeps_its_earlier_committed_batches():
    earlier = build(fixed(5), base=0, producer_id=7, transactional=True)
    marker = build([(struct.pack(">hh", 0, 1), b"\0" * 6, [])], base=5, producer_id=7, control=True)
    later = build(fixed(5, seed=5), base=6, producer_id=7, transactional=True)
    result = parse_batches(earlier + marker + later, decompress, [(7, 6)])
    assert result.fields.offsets.tolist() == list(range(5))


def test_records_of_alternating_sizes_are_found_one_by_one():
    records = [(None, b"x" * (800 + i % 3), []) for i in range(500)]
    buf = build(records)
    assert parsed(buf) == oracle(buf)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:16] + b"\x01" + b[17:], "message format v1"),
        (lambda b: b[:61] + b"\xff" * 6 + b[67:], "not parse"),
        (lambda b: b[:57] + struct.pack(">i", 99) + b[61:], "not parse"),
        (lambda b: b[:8] + struct.pack(">i", 20) + b[12:], "under its header"),
    ],
    ids=["old-format", "bad-varint", "wrong-count", "short-batch"],
)
def test_a_malformed_batch_is_an_error_naming_its_offset(damage, message):
    buf = damage(build(fixed(20), base=500))
    with pytest.raises(RecordBatchError, match=message) as caught:
        parse_batches(buf, decompress)
    assert "offset 500" in str(caught.value)


def test_varints_decode_as_zigzag_and_mark_the_overlong():
    data = np.frombuffer(bytes([0x02, 0x03, 0xAC, 0x02, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x00]), np.uint8)
    values, lengths = varints_at(data, np.array([0, 1, 2, 4]))
    assert values[:3].tolist() == [1, -2, 150] and lengths[:3].tolist() == [1, 1, 2]
    assert lengths[3] == 0  # five continuation bytes: no varint of at most five bytes


def test_columns_concatenate_with_their_positions_moved():
    first, second = columns(build(fixed(10, size=8)), 3), columns(build(fixed(10, size=8, seed=9), base=10), 3)
    joined = RecordColumns.concat([first[2:], second])
    assert [r.offset for r in joined] == list(range(2, 20))
    assert list(joined.values) == [v for _, v, _ in fixed(10, size=8)[2:] + fixed(10, size=8, seed=9)]
    assert joined[0].partition == 3

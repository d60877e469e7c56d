"""Fast protobuf decoding of ``kbit.Sample`` without upb's per-record attribute access: the list layout scans
each record's wire format and cuts the packed float field out as raw little-endian bytes; the bytes layout reads
a batch by template, as one ``(n, length)`` byte matrix per value length.

Both take the field encoding kbit's writer (and any proto3 writer) produces: each known field at most once, in
field-number order (the list scan also takes other orders), ``data`` and ``shape`` packed, a ``SampleBatch`` as
its samples followed by their count. Anything else (unknown or repeated fields, unpacked repeats, the other
layout's field set, varints over 9 bytes) goes to upb, which applies protobuf's merge rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kbit_core.formats.fast.base import Columns, Defer, FastPath, by_length, byte_matrix, key_groups, read_varint
from kbit_core.formats.protobuf_codec import ProtobufCodec
from kbit_core.formats.schemas import kbit_pb2

TAG_INDEX, TAG_LABEL, TAG_DATA, TAG_SHAPE = 0x08, 0x10, 0x1A, 0x2A  # Sample fields 1, 2, 3 (packed), 5 (packed)
TAG_SAMPLES, TAG_COUNT = 0x0A, 0x10  # SampleBatch fields 1 (message), 2 (varint)
MAX_HEADER = 20  # an index and a label field of at most 9 varint bytes each, with their tags


def signed(value: int, bits: int) -> int:
    """The two's-complement reading of the low ``bits`` bits, as upb stores int32/int64 fields."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def varint_column(rows: np.ndarray, start: int, width: int) -> np.ndarray:
    """The unsigned varints that fill columns ``start:start + width`` of every row (their continuation bits
    already checked), as uint64; width <= 9, so they fit in 63 bits."""
    groups = rows[:, start : start + width].astype(np.uint64) & np.uint64(0x7F)
    return (groups << (np.uint64(7) * np.arange(width, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)


class FastProtobufCodec(FastPath, ProtobufCodec):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The end of every bytes-layout Sample: index and label are 0 here, so proto3 leaves them out, and what
        # remains (pixels tag and length, the pixels, the packed shape) has one length for the topic.
        tail = kbit_pb2.Sample(pixels=bytes(self.record_bytes), shape=self.image_shape).SerializeToString()
        self._pixels_at = tail.index(bytes(self.record_bytes))
        self._tail = np.frombuffer(tail, dtype=np.uint8)

    def _fast_columns(self, values: Sequence[bytes]) -> Columns:
        samples = values if self.records_per_message == 1 else [s for v in values for s in self._batch_samples(v)]
        if self.layout == "bytes":
            return self._by_template(samples)
        indices: list[int] = []
        labels: list[int] = []
        pieces: list[bytes] = []
        for sample in samples:
            self._sample(sample, 0, len(sample), indices, labels, pieces)
        pixels = np.frombuffer(b"".join(pieces), dtype="<f4").astype(np.float32, copy=False)
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels

    def _batch_samples(self, value: bytes) -> list[bytes]:
        """The serialized samples of a ``SampleBatch`` that holds its samples, then their count."""
        pos, samples = 0, []
        while value[pos] == TAG_SAMPLES:
            length, pos = read_varint(value, pos + 1, 10)
            samples.append(value[pos : pos + length])
            pos += length
        if value[pos] != TAG_COUNT:
            raise Defer(f"tag {value[pos]:#x} in a SampleBatch")
        count, pos = read_varint(value, pos + 1, 10)
        if pos != len(value) or count != len(samples) or not 1 <= len(samples) <= self.records_per_message:
            raise Defer("sample count, value end or count field disagree")
        return samples

    def _by_template(self, samples: Sequence[bytes]) -> Columns:
        return by_length(samples, self._same_length)

    def _same_length(self, samples: list[bytes]) -> Columns:
        """Bytes-layout samples of one length whose last bytes are the tail's (pixels field of C*H*W bytes, then
        the shape) and whose first bytes hold nothing but the index and label fields."""
        rows, size, at, tail = byte_matrix(samples), self.record_bytes, self._pixels_at, self._tail
        head = rows.shape[1] - len(tail)
        if not 0 <= head <= MAX_HEADER:
            raise Defer("a sample's length leaves no room for the fields the tail lacks")
        if (rows[:, head : head + at] != tail[:at]).any() or (rows[:, head + at + size :] != tail[at + size :]).any():
            raise Defer("the pixels' tag or length, or the shape field, differs from the template")
        indices, labels = self._index_and_label(rows[:, :head])
        return indices, labels, rows[:, head + at : head + at + size]

    @staticmethod
    def _index_and_label(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Index and label of rows that start with ``[0x08 varint][0x10 varint]`` (either may be absent). Rows
        whose first byte is (or is not) TAG_LABEL and whose bytes have the same continuation bits have their
        fields in the same columns: each such group is read column-wise along its first row's layout."""
        indices, labels = np.zeros(len(head), dtype=np.int64), np.zeros(len(head), dtype=np.int64)
        if not head.shape[1]:
            return indices, labels
        continued = (head >= 0x80) @ (1 << np.arange(head.shape[1], dtype=np.int64))
        for _, rows in key_groups(2 * continued + (head[:, 0] == TAG_LABEL)):
            group = head[rows]
            first, pos = group[0].tobytes(), 0
            for tag, column in ((TAG_INDEX, indices), (TAG_LABEL, labels)):
                if pos < len(first) and first[pos] == tag:
                    if (group[:, pos] != tag).any():
                        raise Defer("a field tag other than index's or label's")
                    _, end = read_varint(first, pos + 1, 9)
                    value = varint_column(group, pos + 1, end - pos - 1)
                    # int32 keeps the low 32 bits of the varint, as upb does; int64 fits them all
                    column[rows] = value if tag == TAG_INDEX else value.astype(np.uint32).view(np.int32)
                    pos = end
            if pos != len(first):
                raise Defer("a field other than index and label before the pixels")
        return indices, labels

    def _sample(
        self, buf: bytes, pos: int, end: int, indices: list[int], labels: list[int], pieces: list[bytes]
    ) -> None:
        index = label = 0  # proto3 leaves zero-valued scalars out
        data = shape = None
        seen = 0
        while pos < end:
            tag = buf[pos]
            if seen & (1 << (tag & 0x3F)):
                raise Defer(f"field tag {tag:#x} repeated")
            seen |= 1 << (tag & 0x3F)
            if tag == TAG_INDEX:
                raw, pos = read_varint(buf, pos + 1, 10)
                index = signed(raw, 64)
            elif tag == TAG_LABEL:
                raw, pos = read_varint(buf, pos + 1, 10)
                label = signed(raw, 32)
            elif tag == TAG_DATA or tag == TAG_SHAPE:
                length, pos = read_varint(buf, pos + 1, 10)
                if tag == TAG_DATA:
                    data = buf[pos : pos + length]
                else:
                    shape = self._packed_ints(buf, pos, pos + length)
                pos += length
            else:
                raise Defer(f"field tag {tag:#x}")
        if pos != end or shape != self.shape_list or data is None or len(data) != 4 * self.record_size:
            raise Defer("value end, shape or pixel count")
        pieces.append(data)
        indices.append(index)
        labels.append(label)

    @staticmethod
    def _packed_ints(buf: bytes, pos: int, end: int) -> list[int]:
        numbers = []
        while pos < end:
            raw, pos = read_varint(buf, pos, 10)
            numbers.append(signed(raw, 32))
        if pos != end:
            raise Defer("packed ints run past their field")
        return numbers

"""Fast protobuf list decoding: scan the ``kbit.Sample`` wire format and cut the packed float field out as raw
little-endian bytes, one ``np.frombuffer`` per batch, instead of one Python float per pixel from upb.

The scan takes the field encoding kbit's writer (and any proto3 writer) produces: each known field at most
once, ``data`` and ``shape`` packed. Anything else (unknown or repeated fields, unpacked repeats, the bytes
field set) goes to upb, which applies protobuf's merge rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kbit_core.formats.fast.base import Defer, FastPath, read_varint
from kbit_core.formats.protobuf_codec import ProtobufCodec

TAG_INDEX, TAG_LABEL, TAG_DATA, TAG_SHAPE = 0x08, 0x10, 0x1A, 0x2A  # Sample fields 1, 2, 3 (packed), 5 (packed)
TAG_SAMPLES, TAG_COUNT = 0x0A, 0x10  # SampleBatch fields 1 (message), 2 (varint)


def signed(value: int, bits: int) -> int:
    """The two's-complement reading of the low ``bits`` bits, as upb stores int32/int64 fields."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


class FastProtobufCodec(FastPath, ProtobufCodec):
    fast_layouts = ("list",)

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        indices: list[int] = []
        labels: list[int] = []
        pieces: list[bytes] = []
        for value in values:
            if self.records_per_message == 1:
                self._sample(value, 0, len(value), indices, labels, pieces)
            else:
                self._batch(value, indices, labels, pieces)
        pixels = np.frombuffer(b"".join(pieces), dtype="<f4").astype(np.float32, copy=False)
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels

    def _batch(self, value: bytes, indices: list[int], labels: list[int], pieces: list[bytes]) -> None:
        pos, end, samples, count = 0, len(value), 0, None
        while pos < end:
            tag = value[pos]
            if tag == TAG_SAMPLES:
                length, pos = read_varint(value, pos + 1, 10)
                self._sample(value, pos, pos + length, indices, labels, pieces)
                pos += length
                samples += 1
            elif tag == TAG_COUNT and count is None:
                count, pos = read_varint(value, pos + 1, 10)
            else:
                raise Defer(f"tag {tag:#x} in a SampleBatch")
        if pos != end or count != samples or not 1 <= samples <= self.records_per_message:
            raise Defer("sample count, value end or count field disagree")

    def _sample(self, buf: bytes, pos: int, end: int, indices: list[int], labels: list[int],
                pieces: list[bytes]) -> None:
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
                    data = buf[pos:pos + length]
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

"""Protocol Buffers: ``kbit.Sample`` / ``kbit.SampleBatch`` from schemas/kbit.proto (generated kbit_pb2.py).

The ``list`` layout fills the packed ``data`` floats, the ``bytes`` layout the ``pixels`` bytes (uint16 token ids
as their little-endian bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from google.protobuf.message import DecodeError

from kbit_core.formats.base import Columns, DecodedBatch, RecordCodec
from kbit_core.formats.schemas import kbit_pb2


class _SamplesPrefixes(dict[int, bytes]):
    """The bytes that frame a serialized ``Sample`` of a given length as one ``SampleBatch.samples`` entry:
    tag 0x0A (field 1, length-delimited), then the length as a varint. Values of a topic share a few lengths."""

    MAX_ENTRIES = 4096  # garbage of ever-new lengths must not grow the cache without bound

    def __missing__(self, length: int) -> bytes:
        if len(self) >= self.MAX_ENTRIES:
            self.clear()
        varint, rest = bytearray(), length
        while rest > 0x7F:
            varint.append(rest & 0x7F | 0x80)
            rest >>= 7
        varint.append(rest)
        prefix = self[length] = b"\x0a" + bytes(varint)
        return prefix


_PREFIXES = _SamplesPrefixes()


class ProtobufCodec(RecordCodec):
    format = "protobuf"
    wide_records = True

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        return self._group_object(indices, labels, pixels).SerializeToString()

    def _group_object(
        self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray
    ) -> kbit_pb2.Sample | kbit_pb2.SampleBatch:
        field = "pixels" if self.layout == "bytes" else "data"
        rows = [row.tobytes() for row in pixels] if self.layout == "bytes" else pixels.tolist()
        samples = [
            kbit_pb2.Sample(index=int(i), label=int(y), shape=self.image_shape, **{field: row})
            for i, y, row in zip(indices, labels, rows)
        ]
        if self.records_per_message == 1:
            return samples[0]
        return kbit_pb2.SampleBatch(samples=samples, count=len(samples))

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        # Grouped values each carry a count that must match their own samples, so they are parsed one by one.
        if self.records_per_message > 1:
            return super()._decode(values)
        # One upb parse for the whole batch instead of one Python-level call per value: each value becomes a
        # length-delimited SampleBatch entry, which upb parses exactly as it parses that value alone.
        parts: list[bytes] = [b""] * (2 * len(values))
        parts[::2] = map(_PREFIXES.__getitem__, map(len, values))
        parts[1::2] = values
        try:
            # A list, because every pass over the repeated field would build a new wrapper per sample.
            samples = list(kbit_pb2.SampleBatch.FromString(b"".join(parts)).samples)
        except DecodeError:
            # Parsing value by value raises the error a single Sample gives, as callers have always seen.
            return super()._decode(values)
        return self._assemble(self._columns(samples))

    _parse_one = staticmethod(kbit_pb2.Sample.FromString)

    def _parse_many(self, value: bytes) -> Sequence[kbit_pb2.Sample]:
        batch = kbit_pb2.SampleBatch.FromString(value)
        if batch.count != len(batch.samples):
            raise ValueError(f"holds {len(batch.samples)} samples but its count field says {batch.count}: truncated")
        return batch.samples

    def _columns(self, records: Sequence[kbit_pb2.Sample]) -> Columns:
        # The hot path of the fastest formats: one comprehension per field, no per-record calls.
        shape = list(self.image_shape)
        if not all(s.shape == shape for s in records):
            self._check_shape(next(s.shape for s in records if s.shape != shape))
        pixels = [s.pixels for s in records] if self.layout == "bytes" else [s.data for s in records]
        if not all(pixels):
            self._explain_empty(records[next(i for i, p in enumerate(pixels) if not p)])
        return Columns([s.index for s in records], [s.label for s in records], pixels)

    def _explain_empty(self, sample: kbit_pb2.Sample) -> None:
        if self.layout == "bytes" and sample.data:
            raise ValueError("float field 'data' is set: the value was written with the list layout")
        if self.layout == "list" and sample.pixels:
            raise ValueError("bytes field 'pixels' is set: the value was written with the bytes layout")

    def _definition(self) -> str:
        return kbit_pb2.DESCRIPTOR.serialized_pb.hex()

"""Protocol Buffers: ``kbit.Sample`` / ``kbit.SampleBatch`` from schemas/kbit.proto (generated kbit_pb2.py).

The ``list`` layout fills the packed ``data`` floats, the ``bytes`` layout the ``pixels`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kbit_core.formats.base import Columns, RecordCodec
from kbit_core.formats.schemas import kbit_pb2


class ProtobufCodec(RecordCodec):
    format = "protobuf"

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        field = "pixels" if self.layout == "bytes" else "data"
        rows = [row.tobytes() for row in pixels] if self.layout == "bytes" else pixels.tolist()
        samples = [kbit_pb2.Sample(index=int(i), label=int(y), shape=self.image_shape, **{field: row})
                   for i, y, row in zip(indices, labels, rows)]
        if self.records_per_message == 1:
            return samples[0].SerializeToString()
        return kbit_pb2.SampleBatch(samples=samples, count=len(samples)).SerializeToString()

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

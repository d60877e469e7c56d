"""BSON (pymongo's C codec): MongoDB documents ``{index: int64, label, data, shape}``.

``list`` layout: ``data`` is an array of doubles in [0, 1]; ``bytes`` layout: a generic Binary of
the uint8 pixels. Several records per message travel as ``{"samples": [documents]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import bson
import numpy as np
from bson.int64 import Int64

from kbit_core.formats.base import Columns, RecordCodec, canonical_json, int_field, required


class BsonCodec(RecordCodec):
    format = "bson"

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        shape = list(self.image_shape)
        data = [row.tobytes() for row in pixels] if self.layout == "bytes" else pixels.tolist()
        docs = [{"index": Int64(i), "label": int(y), "data": d, "shape": shape}
                for i, y, d in zip(indices, labels, data)]
        return bson.encode(docs[0] if self.records_per_message == 1 else {"samples": docs})

    _parse_one = staticmethod(bson.decode)

    def _parse_many(self, value: bytes) -> Sequence[Any]:
        docs = required(bson.decode(value), "samples")
        if not isinstance(docs, list):
            raise ValueError(f"field 'samples' must be an array, got {type(docs).__name__}")
        return docs

    def _columns(self, records: Sequence[Any]) -> Columns:
        expected = bytes if self.layout == "bytes" else list
        columns = Columns()
        for doc in records:
            data = required(doc, "data")
            if type(data) is not expected:
                raise ValueError(f"field 'data' must be {'binary' if expected is bytes else 'an array'} in the "
                                 f"{self.layout} layout, got {type(data).__name__}")
            self._check_shape(required(doc, "shape"))
            columns.add(int_field(doc, "index"), int_field(doc, "label"), data)
        return columns

    def _definition(self) -> str:
        data = "binary(subtype 0) uint8[C*H*W]" if self.layout == "bytes" else "array<double> C*H*W in [0, 1]"
        sample = {"index": "int64", "label": "int32", "data": data, "shape": "array<int32> [C, H, W]"}
        return canonical_json(sample if self.records_per_message == 1 else {"samples": [sample]})

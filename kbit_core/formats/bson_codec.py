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

from kbit_core.formats.base import Columns, DecodedBatch, RecordCodec, canonical_json, int_field, required


class BsonCodec(RecordCodec):
    format = "bson"

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        shape = list(self.image_shape)
        data = [row.tobytes() for row in pixels] if self.layout == "bytes" else pixels.tolist()
        docs = [
            {"index": Int64(i), "label": int(y), "data": d, "shape": shape} for i, y, d in zip(indices, labels, data)
        ]
        return bson.encode(docs[0] if self.records_per_message == 1 else {"samples": docs})

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        docs = self._decode_all(values)
        if docs is None:
            # Parsing value by value raises the error a single document gives, as callers have always seen.
            return super()._decode(values)
        if self.records_per_message > 1:
            docs = [r for doc in docs for r in self._group(self._samples(doc))]
        return self._assemble(self._columns(docs))

    def _decode_all(self, values: Sequence[bytes]) -> list[Any] | None:
        """Every value's document from one ``bson.decode_all`` call, or None when that cannot stand in for
        decoding the values one by one.

        BSON documents are self-delimiting, so a concatenation splits where each value's leading int32 size
        says. Only when every size equals its value's length (no truncated value, no trailing bytes) does
        the concatenation split exactly at the value boundaries.
        """
        sizes = b"".join([v[:4] for v in values])
        if len(sizes) != 4 * len(values) or not np.array_equal(
            np.frombuffer(sizes, dtype="<i4"), np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        ):
            return None
        try:
            return bson.decode_all(b"".join(values))
        except Exception:  # noqa: BLE001 - pymongo raises several types for malformed input; one by one names it
            return None

    _parse_one = staticmethod(bson.decode)

    def _parse_many(self, value: bytes) -> Sequence[Any]:
        return self._samples(bson.decode(value))

    @staticmethod
    def _samples(doc: Any) -> list[Any]:
        docs = required(doc, "samples")
        if not isinstance(docs, list):
            raise ValueError(f"field 'samples' must be an array, got {type(docs).__name__}")
        return docs

    def _columns(self, records: Sequence[Any]) -> Columns:
        # One comprehension per field; any record the checks below do not clear goes through the per-record
        # checks, which accept or name what is wrong exactly as before.
        try:
            indices = [doc["index"] for doc in records]
            labels = [doc["label"] for doc in records]
            data = [doc["data"] for doc in records]
            shapes = [doc["shape"] for doc in records]
        except (KeyError, TypeError):
            return self._checked_columns(records)
        integers = {int, Int64}
        if (
            set(map(type, data)) <= {bytes if self.layout == "bytes" else list}
            and shapes.count(list(self.image_shape)) == len(shapes)
            and set(map(type, indices)) <= integers
            and set(map(type, labels)) <= integers
        ):
            return Columns(indices, labels, data)
        return self._checked_columns(records)

    def _checked_columns(self, records: Sequence[Any]) -> Columns:
        expected = bytes if self.layout == "bytes" else list
        columns = Columns()
        for doc in records:
            data = required(doc, "data")
            if type(data) is not expected:
                raise ValueError(
                    f"field 'data' must be {'binary' if expected is bytes else 'an array'} in the "
                    f"{self.layout} layout, got {type(data).__name__}"
                )
            self._check_shape(required(doc, "shape"))
            columns.add(int_field(doc, "index"), int_field(doc, "label"), data)
        return columns

    def _definition(self) -> str:
        data = "binary(subtype 0) uint8[C*H*W]" if self.layout == "bytes" else "array<double> C*H*W in [0, 1]"
        sample = {"index": "int64", "label": "int32", "data": data, "shape": "array<int32> [C, H, W]"}
        return canonical_json(sample if self.records_per_message == 1 else {"samples": [sample]})

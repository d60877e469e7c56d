"""JSON (orjson): the original DDP_KBIT consumer's ``{"data": [floats], "label": int}`` plus index and shape.

``list`` layout: ``data`` is the C*H*W floats in [0, 1]; ``bytes`` layout: ``data`` is the base64
of the uint8 pixels. Several records per message travel as a JSON array of such objects.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from kbit_core.formats.base import Columns, RecordCodec, canonical_json, int_field, required


class JsonCodec(RecordCodec):
    format = "json"

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        # float32 rows, serialized by orjson's numpy support
        docs = self._docs(indices, labels, list(pixels) if self.layout == "list" else pixels)
        return orjson.dumps(docs[0] if self.records_per_message == 1 else docs, option=orjson.OPT_SERIALIZE_NUMPY)

    def _group_object(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> Any:
        # plain Python floats (the same float32 values) for serializers that cannot take numpy rows
        docs = self._docs(indices, labels, pixels.tolist() if self.layout == "list" else pixels)
        return docs[0] if self.records_per_message == 1 else docs

    def _docs(self, indices: np.ndarray, labels: np.ndarray, data: Any) -> list[dict[str, Any]]:
        if self.layout == "bytes":
            data = [base64.b64encode(row.tobytes()).decode("ascii") for row in data]
        shape = list(self.image_shape)
        return [{"data": d, "label": int(y), "index": int(i), "shape": shape} for d, y, i in zip(data, labels, indices)]

    def json_schema(self) -> dict[str, Any]:
        """A JSON Schema of the values: what a registry registers."""
        data = {"type": "string"} if self.layout == "bytes" else {"type": "array", "items": {"type": "number"}}
        integer = {"type": "integer"}
        sample = {
            "type": "object",
            "properties": {
                "data": data,
                "label": integer,
                "index": integer,
                "shape": {"type": "array", "items": integer},
            },
            "required": ["data", "label", "index", "shape"],
        }
        return sample if self.records_per_message == 1 else {"type": "array", "items": sample}

    _parse_one = staticmethod(orjson.loads)

    def _parse_many(self, value: bytes) -> Sequence[Any]:
        docs = orjson.loads(value)
        if not isinstance(docs, list):
            raise ValueError(f"expected a JSON array of samples, got {type(docs).__name__}")
        return docs

    def _columns(self, records: Sequence[Any]) -> Columns:
        columns = Columns()
        for doc in records:
            data = required(doc, "data")
            self._check_shape(required(doc, "shape"))
            if self.layout == "bytes":
                if not isinstance(data, str):
                    raise ValueError(f"field 'data' must be a base64 string, got {type(data).__name__}")
                data = binascii.a2b_base64(data, strict_mode=True)
            elif not isinstance(data, list):
                raise ValueError(f"field 'data' must be a list of floats, got {type(data).__name__}")
            columns.add(int_field(doc, "index"), int_field(doc, "label"), data)
        return columns

    def _definition(self) -> str:
        data = "base64 string of uint8[C*H*W]" if self.layout == "bytes" else "array of C*H*W floats in [0, 1]"
        sample = {"data": data, "label": "int", "index": "int", "shape": "[C, H, W]"}
        return canonical_json(sample if self.records_per_message == 1 else [sample])

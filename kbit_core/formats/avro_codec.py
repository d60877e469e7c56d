"""Schemaless Avro (fastavro): the original's MNISTImage v2 records, no container header, no magic byte.

Schemas ship as .avsc files in ``kbit_core/formats/schemas``; a schema that names another type
(``"type": "Meta"``) is parsed after the file defining it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from typing import Any

import fastavro
import numpy as np
from fastavro.schema import to_parsing_canonical_form

from kbit_core.formats.base import Columns, RecordCodec

AVRO_INT_MAX = 2**31 - 1


@cache
def load_avro_schema(*names: str) -> tuple[dict[str, Any], str]:
    """Parse ``schemas/<name>.avsc`` in order, later ones may refer to earlier ones by name.

    Returns:
        (the last schema, parsed for fastavro; the canonical forms of all of them, one per line).
    """
    named: dict[str, Any] = {}
    directory = files("kbit_core.formats") / "schemas"
    parsed = [
        fastavro.parse_schema(json.loads((directory / f"{name}.avsc").read_text()), named_schemas=named)
        for name in names
    ]
    return parsed[-1], "\n".join(to_parsing_canonical_form(p) for p in parsed)


def _inlined(node: Any, named: dict[str, Any], defined: set[str]) -> Any:
    """An Avro schema with each type it names by a name in ``named`` defined in place at its first use."""
    if isinstance(node, str):
        if node in named and node not in defined:
            defined.add(node)
            return _inlined(named[node], named, defined)
        return node
    if isinstance(node, list):
        return [_inlined(branch, named, defined) for branch in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("type", "items", "values"):
        if key in out:
            out[key] = _inlined(out[key], named, defined)
    if isinstance(out.get("fields"), list):
        out["fields"] = [{**f, "type": _inlined(f["type"], named, defined)} for f in out["fields"]]
    return out


class AvroCodec(RecordCodec):
    format = "avro"
    schema_files = {"list": ("Meta", "MNISTImage"), "bytes": ("Meta", "MNISTImageBytes")}
    batch_schema_files = {"list": "MNISTImageBatch", "bytes": "MNISTImageBytesBatch"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = self.schema_files[self.layout]
        if self.records_per_message > 1:
            names = (*names, self.batch_schema_files[self.layout])
        self._schema_names = names
        self._schema, self._canonical = load_avro_schema(*names)

    def _meta(self, index: int) -> dict[str, Any]:
        # MNISTImage v2's Meta: the producer-side partition and compression are not known here, and a
        # fixed timestamp keeps encoding deterministic.
        return {"index": index, "partition": 0, "timestamp": 0, "format": self.format, "compression": ""}

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self._schema, self._group_object(indices, labels, pixels))
        return out.getvalue()

    def _group_object(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> dict[str, Any]:
        if indices.size and indices.max() > AVRO_INT_MAX:
            raise ValueError(f"{self.name}: sample index {indices.max()} does not fit the schema's Avro int")
        shape = list(self.image_shape)
        data = [row.tobytes() for row in pixels] if self.layout == "bytes" else pixels.tolist()
        records = [
            {"data": d, "shape": shape, "label": int(y), "meta": self._meta(int(i))}
            for d, y, i in zip(data, labels, indices)
        ]
        return records[0] if self.records_per_message == 1 else {"items": records}

    def schema_text(self) -> str:
        """The schema as one self-contained JSON text (each named type defined where first used): what a registry
        registers."""
        directory = files("kbit_core.formats") / "schemas"
        raw = [json.loads((directory / f"{name}.avsc").read_text()) for name in self._schema_names]
        return json.dumps(_inlined(raw[-1], {r["name"]: r for r in raw[:-1]}, set()))

    def _parse_one(self, value: bytes) -> dict[str, Any]:
        stream = io.BytesIO(value)
        record = fastavro.schemaless_reader(stream, self._schema, None)
        if stream.tell() != len(value):
            raise ValueError(f"{len(value) - stream.tell()} trailing bytes after the Avro record")
        return record

    def _parse_many(self, value: bytes) -> Sequence[dict[str, Any]]:
        return self._parse_one(value)["items"]

    def _columns(self, records: Sequence[dict[str, Any]]) -> Columns:
        columns = Columns()
        for r in records:
            self._check_shape(r["shape"])
            columns.add(r["meta"]["index"], r["label"], r["data"])
        return columns

    def _definition(self) -> str:
        return self._canonical

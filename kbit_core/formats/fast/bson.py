"""Fast BSON decoding by template: kbit's documents have one byte layout per topic (int64 index, int32 label,
a double array or binary of C*H*W pixels, the shape array), so a batch of values of that length becomes one
``(n, length)`` byte matrix. Every byte outside the index, label and pixel values must equal the template's,
checked in one comparison; then each column is cut out with strided views. A value of another length or with
any other byte differing (another type, key order, extra field) goes to pymongo.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kbit_core.formats.bson_codec import BsonCodec
from kbit_core.formats.fast.base import Defer, FastPath, UnsupportedSchema

VALUE_SIZES = {0x01: 8, 0x10: 4, 0x12: 8}  # double, int32, int64
DOCUMENT_TYPES = (0x03, 0x04)  # embedded document, array
BINARY = 0x05


class Leaf(NamedTuple):
    path: tuple[str, ...]
    type: int
    offset: int  # first byte of the value (for binary: of the payload)
    size: int


def leaves(doc: bytes, pos: int = 0, path: tuple[str, ...] = ()) -> list[Leaf]:
    """Every scalar value of a BSON document with its offset, in document order."""
    (size,) = struct.unpack_from("<i", doc, pos)
    end, pos, out = pos + size - 1, pos + 4, []
    while pos < end:
        kind, key_end = doc[pos], doc.index(0, pos + 1)
        key, pos = doc[pos + 1:key_end].decode(), key_end + 1
        if kind in DOCUMENT_TYPES:
            out += leaves(doc, pos, (*path, key))
            pos += struct.unpack_from("<i", doc, pos)[0]
        elif kind == BINARY:
            (length,) = struct.unpack_from("<i", doc, pos)
            out.append(Leaf((*path, key), kind, pos + 5, length))
            pos += 5 + length
        elif kind in VALUE_SIZES:
            out.append(Leaf((*path, key), kind, pos, VALUE_SIZES[kind]))
            pos += VALUE_SIZES[kind]
        else:
            raise UnsupportedSchema(f"BSON type {kind:#x} at {'.'.join(path + (key,))}")
    return out


def strided_columns(buffer: bytes, rows: int, row_size: int, offsets: Sequence[int], dtype: str) -> np.ndarray:
    """The ``dtype`` value at each offset of each row of ``buffer``, as (rows, len(offsets)). Offsets that step by
    a constant stride become one strided (unaligned) view each: BSON array keys grow from 1 to 3 digits, so a
    784-double array is 3 views, and a grouped value's records are one."""
    parts, start = [], 0
    steps = np.diff(offsets)
    while start < len(offsets):
        stop = start + 1
        while stop < len(offsets) and (stop == start + 1 or steps[stop - 1] == steps[start]):
            stop += 1
        stride = int(steps[start]) if stop - start > 1 else 0
        parts.append(np.ndarray((rows, stop - start), dtype=dtype, buffer=buffer, offset=offsets[start],
                                strides=(row_size, stride)))
        start = stop
    return np.concatenate(parts, axis=1)


class FastBsonCodec(FastPath, BsonCodec):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rpm, shape = self.records_per_message, self.image_shape
        zeros = np.zeros((rpm, *shape), dtype=np.uint8)
        self._template = np.frombuffer(self.encode(np.zeros(rpm, np.int64), zeros, np.zeros(rpm, np.int64))[0],
                                       dtype=np.uint8)
        found = leaves(self._template.tobytes())
        pixel_type = BINARY if self.layout == "bytes" else 0x01
        prefix = ("samples",) if rpm > 1 else ()
        self._index, self._label, self._pixels = [], [], []
        for record in range(rpm):
            path = (*prefix, str(record)) if rpm > 1 else ()
            named = {leaf.path[len(path):]: leaf for leaf in found if leaf.path[:len(path)] == path}
            if named.get(("index",), Leaf((), 0, 0, 0)).type != 0x12 or named.get(("label",), Leaf((), 0, 0, 0)).type != 0x10:
                raise UnsupportedSchema("the template's index is not int64 or its label not int32")
            self._index.append(named[("index",)].offset)
            self._label.append(named[("label",)].offset)
            data = [leaf for key, leaf in named.items() if key[:1] == ("data",)]
            if {leaf.type for leaf in data} != {pixel_type}:
                raise UnsupportedSchema("the template's pixels are not of the layout's type")
            self._pixels.append([leaf.offset for leaf in data])
        if self.layout == "bytes":
            if any(len(offsets) != 1 for offsets in self._pixels):
                raise UnsupportedSchema("the template's pixels are not one binary per record")
            self._pixels = [offsets[0] for offsets in self._pixels]
        pixel_width = self.record_size if self.layout == "bytes" else 8
        variable = np.zeros(len(self._template), dtype=bool)
        for offsets, width in ((self._index, 8), (self._label, 4), *((o, pixel_width) for o in self._pixels)):
            for o in np.atleast_1d(offsets):
                variable[o:o + width] = True
        # 0xFF over the bytes every value must share with the template, 0 over its index, label and pixels
        self._fixed = np.where(variable, 0, 0xFF).astype(np.uint8)

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        length, n = len(self._template), len(values)
        if any(len(v) != length for v in values):
            raise Defer("a value's length differs from the template's")
        buffer = b"".join(values)
        rows = np.frombuffer(buffer, dtype=np.uint8).reshape(n, length)
        if ((rows ^ self._template) & self._fixed).any():
            raise Defer("a byte outside the index, label and pixels differs from the template")
        indices = strided_columns(buffer, n, length, self._index, "<i8").reshape(-1)
        labels = strided_columns(buffer, n, length, self._label, "<i4").reshape(-1)
        if self.layout == "bytes":
            pixels = np.concatenate([rows[:, o:o + self.record_size] for o in self._pixels], axis=1)
        else:
            pixels = np.concatenate([strided_columns(buffer, n, length, offsets, "<f8") for offsets in self._pixels],
                                    axis=1).astype(np.float32)
        return indices.astype(np.int64), labels.astype(np.int64), pixels.reshape(-1)

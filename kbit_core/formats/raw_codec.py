"""raw: the speed baseline, fixed little-endian binary decoded with one ``np.frombuffer`` per batch.

Value layout::

    header  <2s B x I H H H   magic b"KB", version, pad, record count, C, H, W     (14 bytes)
    count × record:  <u8 index, <u2 label, uint8 pixels[C*H*W]                      (10 + C*H*W bytes)

Version 1 records hold uint8 elements (images); version 2 records hold little-endian uint16 elements (token ids),
2 bytes each. A record shape of fewer than three sizes fills the header's C, H, W from the left with 1s: a
sequence of L tokens is (1, 1, L).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kbit_core.errors import ConfigError
from kbit_core.formats.base import Codec, DecodedBatch, canonical_json, value_lengths
from kbit_core.formats.fast.base import byte_matrix

MAGIC = b"KB"
VERSIONS = {"uint8": 1, "uint16": 2}  # by element type
HEADER = struct.Struct("<2sBxIHHH")
MAX_LABEL = 2**16 - 1


class RawCodec(Codec):
    format = "raw"
    layouts = ("bytes",)
    wide_records = True
    unsupported_layout_reason = (
        "raw is the packed-uint8 speed baseline; floats would only make a slower copy "
        "of it. Use layout 'bytes' (or another format for float lists)."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if any(d > 0xFFFF for d in self.image_shape):
            raise ConfigError(f"raw stores C, H, W as uint16; image shape {self.image_shape} is too large")
        self._version = VERSIONS[self.dtype.name]
        self._header_shape = (1,) * (3 - len(self.image_shape)) + self.image_shape
        self._record = np.dtype([("index", "<u8"), ("label", "<u2"), ("pixels", self.dtype.str, self.image_shape)])
        self._full_header = self._header(self.records_per_message)
        self._full_message = np.dtype(
            [("header", "u1", HEADER.size), ("records", self._record, (self.records_per_message,))]
        )

    def _header(self, count: int) -> bytes:
        return HEADER.pack(MAGIC, self._version, count, *self._header_shape)

    def _encode(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> list[bytes]:
        if labels.size and labels.max() > MAX_LABEL:
            raise ValueError(f"{self.name}: label {labels.max()} does not fit raw's uint16 label field")
        records = np.empty(len(indices), dtype=self._record)
        records["index"], records["label"] = indices, labels
        records["pixels"] = pixels.reshape(len(indices), *self.image_shape)
        buffer, size, step = records.tobytes(), self._record.itemsize, self.records_per_message
        return [
            self._header(min(step, len(indices) - i)) + buffer[i * size : (i + step) * size]
            for i in range(0, len(indices), step)
        ]

    def _full_messages(self, values: Sequence[bytes]) -> np.ndarray:
        """Full-group values as one array of messages (a fetched column's rows viewed where they lie)."""
        if not len(values):
            return np.empty(0, dtype=self._full_message)
        return byte_matrix(values).view(self._full_message)[:, 0]

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        full = self._full_message.itemsize
        if (value_lengths(values) == full).all():
            # Every value is a full group: one join, one frombuffer, one vectorised header check.
            messages = self._full_messages(values)
            bad = np.flatnonzero((messages["header"] != np.frombuffer(self._full_header, np.uint8)).any(axis=1))
            if bad.size:
                raise ValueError(self._header_problem(values[bad[0]]) or "bad header")
            # [messages, records per message]: flattening the records first would copy every record once more
            records = messages["records"]
        else:
            problem = next(filter(None, map(self._header_problem, values)), "")
            if problem:
                raise ValueError(problem)
            records = np.frombuffer(b"".join(v[HEADER.size :] for v in values), dtype=self._record)
        n = records.size
        return self._finish(
            records["index"].astype(np.int64).reshape(n),
            records["label"].astype(np.int64).reshape(n),
            np.ascontiguousarray(records["pixels"]).reshape(n, *self.image_shape),
        )

    def _header_problem(self, value: bytes) -> str:
        """Why a value's header does not match this codec, or "" when it does."""
        if len(value) < HEADER.size:
            return f"shorter than the {HEADER.size}-byte header"
        magic, version, count, *shape = HEADER.unpack_from(value)
        if magic != MAGIC or version != self._version:
            return f"bad magic/version {magic!r}/{version}, expected {MAGIC!r}/{self._version}"
        if tuple(shape) != self._header_shape:
            return f"shape {shape} does not match the codec's image shape {list(self._header_shape)}"
        if not 1 <= count <= self.records_per_message:
            return f"header count {count} is not in 1..{self.records_per_message}"
        expected = HEADER.size + count * self._record.itemsize
        if len(value) != expected:
            return f"{len(value)} bytes, but a header count of {count} needs {expected}"
        return ""

    def _definition(self) -> str:
        return canonical_json(
            {"header": HEADER.format, "magic": MAGIC.decode(), "version": self._version, "record": self._record.descr}
        )

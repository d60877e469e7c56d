"""Fast JSON list decoding with simdjson: each record's float array goes from text straight into a buffer of
doubles (``Array.as_buffer``), with no Python float per pixel; doubles become float32 exactly as the stock
orjson + numpy path converts them.

Measured on 784-float records (same machine, same values): orjson ≈ 35 µs + np.fromiter ≈ 10 µs per record,
numpy's text parser (``np.fromstring``) ≈ 55 µs, pyarrow's JSON reader ≈ 50 µs, simdjson ≈ 13 µs; all four
parse to correctly rounded doubles, so simdjson is the one used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import simdjson

from kbit_core.formats.fast.base import Defer, FastPath
from kbit_core.formats.json_codec import JsonCodec


class FastJsonCodec(FastPath, JsonCodec):
    fast_layouts = ("list",)

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # A parser refuses to parse again while objects of its last document live, and a failed batch may
        # leave some in a traceback: a fresh parser per batch keeps batches independent.
        parser = simdjson.Parser()
        indices: list[int] = []
        labels: list[int] = []
        pieces: list[Any] = []
        for value in values:
            self._take(parser, value, indices, labels, pieces)
        pixels = np.frombuffer(b"".join(pieces), dtype=np.float64).astype(np.float32)
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels

    def _take(self, parser: simdjson.Parser, value: bytes, indices: list[int], labels: list[int],
              pieces: list[Any]) -> None:
        """Append one value's records; the document's objects die with this frame, before the next parse."""
        doc = parser.parse(value)
        if self.records_per_message == 1:
            docs = [doc]
        elif isinstance(doc, simdjson.Array) and 1 <= len(doc) <= self.records_per_message:
            docs = list(doc)
        else:
            raise Defer("not an array of 1..records_per_message samples")
        for sample in docs:
            if not isinstance(sample, simdjson.Object):
                raise Defer("a sample is not an object")
            keys = list(sample.keys())
            if len(set(keys)) != len(keys):
                raise Defer("duplicate keys (orjson keeps the last one)")
            data, index, label = sample["data"], sample["index"], sample["label"]
            if not isinstance(data, simdjson.Array) or len(data) != self.record_size:
                raise Defer("data is not an array of C*H*W numbers")
            if type(index) is not int or type(label) is not int or sample["shape"].as_list() != self.shape_list:
                raise Defer("index, label or shape is not what the stock checks accept")
            pieces.append(data.as_buffer(of_type="d"))
            indices.append(index)
            labels.append(label)

"""Fast JSON decoding: the list layout by template and simdjson.

List layout: kbit's writer gives every record one text, ``{"data":[<numbers>],"label":L,"index":I,"shape":[C,H,W]}``.
A value is read backwards from its end (``_take``): label, index and shape must be that text exactly and the
float array must nest no array; simdjson parses the value and hands the array over as a buffer of doubles
(``Array.as_buffer``), with no Python float per pixel, converted to float32 as the stock orjson + numpy path
converts them. Any other text (whitespace, another key order, a repeated key, a sign) goes to orjson.

The parse is the cost. CPU time per 784-float record of synthetic digits (3.9 KB of text), one 4,096-value
block, 2026-11-22, 2-core VM at load average 6-7: simdjson 11.0 µs (parse, ``as_buffer`` and the join). Whole-
batch C parsers over the same arrays joined into one text, all exact (bit-equal doubles on 17-digit,
subnormal, float32-midpoint and exponent spellings) except pandas' default, were slower before any validation:
pyarrow's CSV reader with 784 float64 columns 22.7 µs (one thread; with threads 27.8 µs of CPU and slower by
the clock on two shared cores), ``np.loadtxt`` 22.5 µs, pyarrow's JSON reader 38 µs, ``np.fromstring(sep=",")``
49 µs, pandas' C parser 30 µs (8,515 of 23,520 doubles off by an ulp) or 92 µs with
``float_precision="round_trip"``. All but pyarrow's JSON reader also accept NaN, Infinity, leading zeros,
"+1", ".5" and "1.", which orjson rejects. One simdjson parse of a block's arrays joined costs what the
per-record parses cost, plus the join. Decode step: 9.3-9.9 µs per record against 42-44 µs for orjson +
``np.fromiter`` (CPU time, best of 15), as fast as the walk over simdjson's objects it replaces (which let a
nested array through: ``as_buffer`` flattens ``[[0.5],0.25,...]``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import simdjson

from kbit_core.formats.fast.base import GROUP_BYTES, Defer, FastPath
from kbit_core.formats.json_codec import JsonCodec


class FastJsonCodec(FastPath, JsonCodec):
    fast_layouts = ("list",)

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._list_columns(values)

    @cached_property
    def _list_tail(self) -> re.Pattern[bytes]:
        """The text kbit's writer puts after a record's float array, to the record's closing brace. Label and index
        are JSON integers of at most 18 digits (they fit int64); a sign or more digits goes to orjson."""
        number = rb"(0|[1-9][0-9]{0,17})"
        shape = ",".join(map(str, self.image_shape)).encode()
        return re.compile(rb'\],"label":' + number + rb',"index":' + number + rb',"shape":\[' + shape + rb"\]\}")

    def _list_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # A parser refuses to parse again while objects of its last document live, and a failed batch may
        # leave some in a traceback: a fresh parser per batch keeps batches independent.
        parser = simdjson.Parser()
        indices: list[int] = []
        labels: list[int] = []
        size = self.record_size
        pixels = np.empty((len(values) * self.records_per_message, size), dtype=np.float32)
        # GROUP_BYTES of doubles at a time into the float32 rows: a whole block's (25 MB for 4,096 records, then
        # joined) took fresh memory pages, which cost more than the conversion
        step = max(1, GROUP_BYTES // (8 * size * self.records_per_message))
        for first in range(0, len(values), step):
            pieces: list[Any] = []
            done = len(indices)
            for value in values[first:first + step]:
                self._take(parser, value, indices, labels, pieces)
            pixels[done:len(indices)] = np.frombuffer(b"".join(pieces), dtype=np.float64).reshape(-1, size)
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels[:len(indices)]

    def _take(self, parser: simdjson.Parser, value: bytes, indices: list[int], labels: list[int],
              pieces: list[Any]) -> None:
        """Append one value's records, found from the value's end backwards: a record ends at the last
        ``],"label":`` and its tail text; a grouped value's record starts at the last ``{`` before that, and the
        records are ``[`` + records joined by ``,`` + ``]``. With no ``[`` inside a record's float array but its
        own, and simdjson accepting the whole value as JSON, the ``]`` before each tail closes that array (an
        earlier one could only close it and leave the later ``]`` closing nothing), so the value holds exactly
        these records, their keys once each. simdjson's objects die with this frame, before the next parse."""
        grouped = int(self.records_per_message > 1)
        if grouped and value[-1:] != b"]":
            raise Defer("not an array of samples")
        tails: list[re.Match[bytes]] = []
        end = len(value) - grouped
        while True:
            close = value.rfind(b'],"label":', 0, end)
            tail = self._list_tail.fullmatch(value, close, end) if close >= 0 else None
            start = value.rfind(b"{", 0, close) if grouped else 0
            if tail is None or start < 0 or not value.startswith(b'{"data":[', start) \
                    or value.find(b"[", start + 9, close) >= 0:
                raise Defer("a record's text is not kbit's (or its array nests one, which as_buffer would flatten)")
            tails.append(tail)
            if start == grouped:
                break
            if not grouped or value[start - 1:start] != b"," or len(tails) == self.records_per_message:
                raise Defer("not records_per_message samples or fewer, joined by commas")
            end = start - 1
        doc = parser.parse(value)
        samples = doc if grouped else [doc]
        if len(samples) != len(tails):
            raise Defer("the records found are not the value's samples")
        for sample, tail in zip(samples, reversed(tails)):
            buffer = sample["data"].as_buffer(of_type="d")
            if buffer.size != 8 * self.record_size:
                raise Defer("data is not an array of C*H*W numbers")
            pieces.append(buffer)
            labels.append(int(tail[1]))
            indices.append(int(tail[2]))

"""Fast JSON decoding by template: the list layout's float arrays through simdjson, the bytes layout's base64
strings through pybase64.

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

Bytes layout: kbit's writer gives every record the same text but for the digits of its label and index and the
base64 characters of its pixels, so the records of a batch are ``(n, length)`` byte matrices, one per length:
the fixed text is compared column-wise, the digits are parsed column-wise (as one group per label width), and
the base64 strings of a part are decoded by one validating pybase64 call once the padding of their last quad
is checked. ``binascii.a2b_base64``, which the stock path calls per record, took 1.3 µs per 1,044 characters
(more than all the rest) and is no faster over the joined strings; pybase64's SIMD decoder takes 0.035 µs.
Any other text (whitespace, another key order, an escape, a sign or a leading zero, a character outside the
alphabet, another padding) goes to orjson and binascii.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pybase64
import simdjson

from kbit_core.formats.fast.base import (
    GROUP_BYTES,
    Columns,
    Defer,
    FastPath,
    UnsupportedSchema,
    by_length,
    byte_matrix,
    key_groups,
)
from kbit_core.formats.json_codec import JsonCodec

MAX_DIGITS = 18  # any 18-digit number fits in int64
ZERO, NINE = ord("0"), ord("9")


class FastJsonCodec(FastPath, JsonCodec):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.layout == "bytes":
            self._init_template()

    def _init_template(self) -> None:
        """Cut the text of one record (index and label 0, zero pixels) into its fixed parts."""
        size = self.record_size
        text = JsonCodec("bytes", self.image_shape)._encode_group(
            np.zeros(1), np.zeros(1), np.zeros((1, size), np.uint8)
        )
        pixels = base64.b64encode(bytes(size))
        data, label, index = (text.find(key) + len(key) for key in (b'"data":"', b'"label":', b'"index":'))
        if not (
            text[data : data + len(pixels)] == pixels
            and text[label : label + 1] == text[index : index + 1] == b"0"
            and data + len(pixels) < label < index
        ):
            raise UnsupportedSchema("the encoder's text is not data, label, index in this order")
        self._text = np.frombuffer(text, dtype=np.uint8)
        self._data, self._data_end, self._label, self._index = data, data + len(pixels), label, index
        self._padding = -size % 3  # "=" characters that end the base64 string
        # the text every record shares: all but the base64 characters and the one-digit label and index
        self._fixed_text = np.concatenate(
            [
                self._text[:data],
                self._text[data + len(pixels) : label],
                self._text[label + 1 : index],
                self._text[index + 1 :],
            ]
        )
        self._layouts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list[int], np.ndarray]] = {}

    def _fast_columns(self, values: Sequence[bytes]) -> Columns:
        if self.layout == "bytes":
            records = values if self.records_per_message == 1 else [r for v in values for r in self._group_records(v)]
            return self._by_template(records)
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
        take = self._take if self.records_per_message > 1 else self._take_one
        for first in range(0, len(values), step):
            pieces: list[Any] = []
            done = len(indices)
            for value in values[first : first + step]:
                take(parser, value, indices, labels, pieces)
            pixels[done : len(indices)] = np.frombuffer(b"".join(pieces), dtype=np.float64).reshape(-1, size)
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels[: len(indices)]

    def _take_one(
        self, parser: simdjson.Parser, value: bytes, indices: list[int], labels: list[int], pieces: list[Any]
    ) -> None:
        """:meth:`_take` for a value of one record, without its search for more (measured: 8.4 against 9.3 µs a
        784-float record, of which simdjson's parse is 5.9)."""
        close = value.rfind(b'],"label":')
        tail = self._list_tail.fullmatch(value, close)
        if tail is None or not value.startswith(b'{"data":[') or value.find(b"[", 9, close) >= 0:
            raise Defer("the record's text is not kbit's (or its array nests one, which as_buffer would flatten)")
        buffer = parser.parse(value)["data"].as_buffer(of_type="d")
        if buffer.size != 8 * self.record_size:
            raise Defer("data is not an array of C*H*W numbers")
        pieces.append(buffer)
        labels.append(int(tail[1]))
        indices.append(int(tail[2]))

    def _take(
        self, parser: simdjson.Parser, value: bytes, indices: list[int], labels: list[int], pieces: list[Any]
    ) -> None:
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
            if (
                tail is None
                or start < 0
                or not value.startswith(b'{"data":[', start)
                or value.find(b"[", start + 9, close) >= 0
            ):
                raise Defer("a record's text is not kbit's (or its array nests one, which as_buffer would flatten)")
            tails.append(tail)
            if start == grouped:
                break
            if not grouped or value[start - 1 : start] != b"," or len(tails) == self.records_per_message:
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

    def _group_records(self, value: bytes) -> list[bytes]:
        """The object texts of a grouped value: with no ``},{`` inside kbit's records, the value is exactly
        ``[`` + the records joined by ``,`` + ``]`` (each record is then checked against the template)."""
        if value[:2] != b"[{" or value[-2:] != b"}]":
            raise Defer("not an array of objects")
        pieces = value[2:-2].split(b"},{")
        if len(pieces) > self.records_per_message:
            raise Defer("more records than records_per_message")
        return [b"{" + piece + b"}" for piece in pieces]

    def _by_template(self, records: Sequence[bytes]) -> Columns:
        return by_length(records, self._same_length)

    def _same_length(self, records: list[bytes]) -> Columns:
        """Records of one length: label digits start at a fixed column, and how many there are places the rest of
        the row, so each group of one label width has every field in fixed columns."""
        rows = byte_matrix(records)
        if rows.shape[1] < len(self._text):
            raise Defer("shorter than a record with one-digit label and index")
        window = rows[:, self._label : self._label + MAX_DIGITS + 1]
        widths = np.argmax((window < ZERO) | (window > NINE), axis=1)
        indices, labels = np.empty(len(rows), dtype=np.int64), np.empty(len(rows), dtype=np.int64)
        for width, at in key_groups(widths):
            group = rows[at]
            fixed, digit_columns, leading, powers = self._template_columns(rows.shape[1], width)
            if (group[:, fixed] != self._fixed_text).any():
                raise Defer("text outside the pixels, label and index differs from the template")
            digits = group[:, digit_columns] - np.uint8(ZERO)  # any other byte wraps past 9
            if (digits > 9).any() or (digits[:, leading] == 0).any():
                raise Defer("a number is not decimal digits without a leading zero")
            labels[at], indices[at] = (digits.astype(np.int64) @ powers).T
        return indices, labels, self._base64(rows[:, self._data : self._data_end])

    def _template_columns(self, length: int, label_width: int) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
        """For records of ``length`` bytes whose label has ``label_width`` digits: the columns of the fixed text,
        those of the label's and the index's digits, which of those must not be a leading zero, and the powers
        of ten that turn the digits into (label, index)."""
        key = (length, label_width)
        if key not in self._layouts:
            data, data_end, label, index = self._data, self._data_end, self._label, self._index
            index_width = length - len(self._text) + 2 - label_width
            if not (1 <= label_width <= MAX_DIGITS and 1 <= index_width <= MAX_DIGITS):
                raise Defer("a label or index of no digit or more than 18")
            index_at = index + label_width - 1  # the template's label is the one digit "0"
            fixed = np.r_[0:data, data_end:label, label + label_width : index_at, index_at + index_width : length]
            digits = np.r_[label : label + label_width, index_at : index_at + index_width]
            leading = [0] * (label_width > 1) + [label_width] * (index_width > 1)
            powers = np.zeros((label_width + index_width, 2), dtype=np.int64)
            powers[:label_width, 0] = 10 ** np.arange(label_width - 1, -1, -1)
            powers[label_width:, 1] = 10 ** np.arange(index_width - 1, -1, -1)
            if len(self._layouts) >= 256:  # garbage of ever-new lengths must not grow it without bound
                self._layouts.clear()
            self._layouts[key] = fixed, digits, leading, powers
        return self._layouts[key]

    def _base64(self, chars: np.ndarray) -> np.ndarray:
        """The pixels from each row's base64 characters, decoded exactly as ``a2b_base64(strict_mode=True)``
        decodes them. The last quad's padding is checked here, then replaced by "A"s, whose bits go to bytes
        past the pixels (binascii ignores the bits the padding leaves over). One validating pybase64 call (SIMD)
        then decodes every row: it raises on a character outside the alphabet, and a ``=`` anywhere else would
        leave its output too short for the reshape (each other character gives 6 bits); on alphabet characters
        every decoder gives the same bytes."""
        text = chars.copy()  # a new contiguous array, even where ``chars`` is one row of a read-only buffer
        pad = self._padding
        if pad:
            if (chars[:, -pad:] != ord("=")).any():
                raise Defer("the base64 string does not end with the padding its length needs")
            text[:, -pad:] = ord("A")
        decoded = pybase64.b64decode(text.data, validate=True)
        rows = np.frombuffer(decoded, dtype=np.uint8).reshape(len(chars), chars.shape[1] // 4 * 3)
        return rows[:, : self.record_size]

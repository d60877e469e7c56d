"""Fast MongoDB-export Avro decoding: the export envelope is checked as the stock codec checks it, and its Avro
payload takes :mod:`.avro`'s fast walk."""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import orjson
import pybase64

from kbit_core.formats.fast.avro import MAX_TEMPLATES, TEMPLATE_MIN_VALUES, FastAvroCodec
from kbit_core.formats.fast.base import Columns, Defer, by_key, by_length
from kbit_core.formats.mongodb_avro_codec import MongoDBAvroCodec


class Envelope(NamedTuple):
    """Where a checked export envelope's ``Data`` string lies, and its bytes before and after it."""

    start: int
    stop: int
    head: np.ndarray
    tail: np.ndarray

    def matches(self, rows: np.ndarray) -> bool:
        """Whether every row (an envelope of this one's length) equals it outside the ``Data`` string."""
        return not ((rows[:, : self.start] != self.head).any() or (rows[:, self.stop :] != self.tail).any())


class FastMongoDBAvroCodec(FastAvroCodec, MongoDBAvroCodec):
    """The export envelope is checked as the stock codec checks it; its Avro payload takes the fast walk.

    Envelopes of one length usually differ only in their base64 ``Data`` string: the first is checked in full, the
    others must equal it byte for byte outside that string, and all the strings are decoded in one strict base64
    call (pybase64, SIMD) into a matrix of Avro payloads, read by template like Avro values.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._envelopes_seen: dict[int, Envelope] = {}  # by value length

    def _fast_columns(self, values: Sequence[bytes]) -> Columns:
        if len(values) < TEMPLATE_MIN_VALUES:
            return self._walker.columns([self._avro_payload(v) for v in values])
        indices, labels, pixels = by_length(values, self._envelopes)
        return indices, labels, pixels.reshape(-1)

    def _envelopes(self, values: list[bytes]) -> Columns:
        if len(values) >= TEMPLATE_MIN_VALUES:
            try:
                payloads, padding = self._payload_rows(values)
                # a payload a byte longer or shorter (an index varint one byte wider) may fill the same base64
                # length with other padding: each padding is one payload length, read as one matrix
                width = payloads.shape[1]
                return by_key(
                    padding, lambda pad, at: self._walker.by_template(payloads[at, : width - pad]), len(values)
                )
            except Defer:
                pass  # an envelope or a payload differs from the first beyond what varies: decode each one
        indices, labels, pixels = self._walker.columns([self._avro_payload(v) for v in values])
        return indices, labels, pixels.reshape(len(indices), -1)

    def _envelope(self, value: bytes) -> Envelope:
        """``value`` checked as the stock codec checks it, and where its ``Data`` string lies; kept for its length's
        next matrix (a few lengths at most, as for Avro templates)."""
        self._avro_payload(value)
        start = value.find(b'"Data":"') + len(b'"Data":"')
        stop = value.find(b'"', start)
        probe = (b"B" if value[start : start + 1] == b"A" else b"A") * (stop - start)
        try:
            found = orjson.loads(value[:start] + probe + value[stop:])["binary_data"]["Data"]
        except (ValueError, LookupError, TypeError) as exc:
            raise Defer(f"the first Data string found is not binary_data.Data: {exc!r}") from exc
        if found != probe.decode():
            raise Defer("the first Data string found is not binary_data.Data")
        row = np.frombuffer(value, dtype=np.uint8)
        envelope = Envelope(start, stop, row[:start], row[stop:])
        if len(self._envelopes_seen) >= MAX_TEMPLATES:
            self._envelopes_seen = {}
        self._envelopes_seen[len(value)] = envelope
        return envelope

    def _payload_rows(self, values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The Avro payloads of envelopes of one length as the rows of one byte matrix, each followed by as many
        zero bytes as its Data string has ``=`` padding, and that padding (0 to 2) per row.

        A checked envelope (the last matrix's of this length, else the first row, see ``_envelope``) is the
        template: its ``Data`` string is the one the stock codec reads (replaced by another string of its length,
        the parsed ``binary_data.Data`` must be that string: a duplicate key or a look-alike elsewhere fails this).
        Every envelope equals it outside that string, so it parses to the same document but for ``Data``, whose
        string then holds only base64 characters (no quote or escape can hide there). The padding is replaced by
        ``A``, so the strings one after another are one unpadded base64 text, decoded by one strict call.
        """
        rows = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), len(values[0]))
        envelope = self._envelopes_seen.get(rows.shape[1])
        if envelope is None or not envelope.matches(rows):
            envelope = self._envelope(values[0])
            if not envelope.matches(rows):
                raise Defer("an envelope differs from the first outside its Data string")
        start, stop = envelope.start, envelope.stop
        texts = rows[:, start:stop].copy()
        pads = texts[:, -2:] == ord("=")
        if (pads[:, 0] & ~pads[:, 1]).any():
            raise Defer("a '=' inside a Data string")
        texts[:, -2:][pads] = ord("A")
        try:
            decoded = pybase64.b64decode(texts, validate=True)
        except binascii.Error as exc:
            raise Defer(f"a Data string is not strict base64: {exc}") from exc
        return np.frombuffer(decoded, dtype=np.uint8).reshape(len(values), -1), pads.sum(axis=1)

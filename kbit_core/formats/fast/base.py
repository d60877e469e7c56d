"""FastPath: a codec mixin that decodes a batch without per-record Python objects and defers to the stock
library on anything it does not recognise, so its results are the stock decoder's, bit for bit.

A fast codec subclasses its stock codec (same encoder, schema and fingerprint) with ``FastPath`` first in
the bases. Its ``_fast_columns`` either returns the batch's ``(indices, labels, pixels [n, C*H*W])`` or raises;
on any exception the batch goes through the stock ``_decode``, which returns the same batch or raises the
stock error, so bad values are named exactly as before. Only results pass through the shared ``_finish``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kbit_core.formats.base import DecodedBatch, value_lengths

log = logging.getLogger(__name__)


class UnsupportedSchema(Exception):
    """The fast path was not written for this schema: the stock decoder is used, with this reason logged."""


class Defer(Exception):
    """A value the fast path leaves to the stock library (an unusual but maybe valid encoding, or garbage)."""


def read_varint(buf: bytes, pos: int, max_bytes: int) -> tuple[int, int]:
    """Unsigned base-128 varint at ``pos`` -> (value, next position); Defer past ``max_bytes`` bytes."""
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    result, shift, limit = byte & 0x7F, 7, 7 * max_bytes
    while True:
        pos += 1
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos + 1
        shift += 7
        if shift >= limit:
            raise Defer(f"varint longer than {max_bytes} bytes")


def key_groups(keys: np.ndarray) -> Iterator[tuple[int, slice | np.ndarray]]:
    """``(key, rows holding it)`` for each distinct key; a single key (the usual block) yields ``slice(None)``,
    so its rows are taken as views, not copied."""
    if keys.size and (keys == keys[0]).all():
        yield int(keys[0]), slice(None)
        return
    for key in np.unique(keys):
        yield int(key), np.flatnonzero(keys == key)


def byte_matrix(values: Sequence[bytes]) -> np.ndarray:
    """Values of one length as the rows of a uint8 matrix (a fetched column's own matrix, maybe a view of the
    fetched bytes, when it has one)."""
    rows = values.matrix() if hasattr(values, "matrix") else None
    if rows is not None:
        return rows
    return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), len(values[0]))


Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # indices, labels, pixels

# Bytes of values per matrix. Whole 4,096-value blocks made malloc hand out fresh pages for every block's matrix
# and temporaries (joined values, base64 text, payloads): ~2,400 page faults, which on the 2-core VM cost more
# than the decoding. Matrices of this size reuse the memory the previous one freed.
GROUP_BYTES = 512 * 1024


def by_key(keys: np.ndarray, decode: Callable[[int, slice | np.ndarray], Columns], part_rows: int) -> Columns:
    """One record per row: ``decode(key, rows)`` decodes the rows holding one key, at most ``part_rows`` at a time
    (``rows`` is a slice where they are consecutive, the usual case), to ``(indices, labels, pixels [k, C*H*W])``,
    pixels maybe a strided view. With several keys or parts their columns are written straight into one array
    each, in row order, so the pixels are copied once; one part is returned as it is."""
    if len(keys) <= part_rows and (keys == keys[0]).all():
        return decode(int(keys[0]), slice(0, len(keys)))
    order = np.argsort(keys, kind="stable")
    indices, labels = np.empty(len(keys), dtype=np.int64), np.empty(len(keys), dtype=np.int64)
    pixels = None
    for group in np.split(order, np.flatnonzero(np.diff(keys[order])) + 1):
        for where in np.array_split(group, -(-len(group) // part_rows)):
            at = slice(int(where[0]), int(where[-1]) + 1) if where[-1] - where[0] + 1 == len(where) else where
            part_indices, part_labels, part_pixels = decode(int(keys[where[0]]), at)
            if pixels is None:
                pixels = np.empty((len(keys), part_pixels.shape[1]), dtype=part_pixels.dtype)
            indices[at], labels[at], pixels[at] = part_indices, part_labels, part_pixels
    return indices, labels, pixels  # type: ignore[return-value]


def by_length(values: Sequence[bytes], decode_group: Callable[[list[bytes]], Columns]) -> Columns:
    """``by_key`` over the values' lengths: ``decode_group`` gets values of one length (for a template decoder,
    one byte matrix), at most ``GROUP_BYTES`` of them."""
    lengths, column = value_lengths(values), hasattr(values, "lengths")
    return by_key(
        lengths,
        lambda _, at: decode_group(values[at] if column else _listed(values, at)),  # type: ignore[index]
        max(1, GROUP_BYTES // max(1, int(lengths.max()))),
    )


def _listed(values: Sequence[bytes], at: slice | np.ndarray) -> list[bytes]:
    return list(values[at]) if isinstance(at, slice) else [values[i] for i in at.tolist()]


class FastPath:
    """Mixin: ``_decode`` through ``_fast_columns``, the stock ``_decode`` when that raises.

    ``fast_layouts`` names the layouts a fast codec reads; for another one it refuses (UnsupportedSchema).
    """

    decoder = "fast"
    fast_layouts: tuple[str, ...] = ("list", "bytes")
    deferred_batches = 0  # batches the stock library decoded (or rejected) instead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.layout not in self.fast_layouts:  # type: ignore[attr-defined]
            raise UnsupportedSchema(
                f"the fast {self.format} decoder reads the {'/'.join(self.fast_layouts)} "  # type: ignore[attr-defined]
                f"layout only"
            )
        self.shape_list = list(self.image_shape)  # type: ignore[attr-defined]

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        try:
            indices, labels, pixels = self._fast_columns(values)
        except Exception as exc:  # noqa: BLE001 - anything unexpected is the stock library's to judge
            self.deferred_batches += 1
            log.debug("%s: fast path deferred %d value(s) to the stock decoder: %r", self.name, len(values), exc)
            return super()._decode(values)  # type: ignore[misc]
        if self.dtype != np.uint8:  # type: ignore[attr-defined]
            # The fast paths cut each record's elements out as bytes: wide ones are read in the codec's dtype.
            pixels = np.ascontiguousarray(pixels).view(self.dtype)  # type: ignore[attr-defined]
        return self._finish(indices, labels, pixels.reshape(len(indices), *self.image_shape))  # type: ignore[attr-defined]

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

"""FastPath: a codec mixin that decodes a batch without per-record Python objects and defers to the stock
library on anything it does not recognise, so its results are the stock decoder's, bit for bit.

A fast codec subclasses its stock codec (same encoder, schema and fingerprint) with ``FastPath`` first in
the bases. Its ``_fast_columns`` either returns the batch's ``(indices, labels, pixels [n, C*H*W])`` or raises;
on any exception the batch goes through the stock ``_decode``, which returns the same batch or raises the
stock error, so bad values are named exactly as before. Only results pass through the shared ``_finish``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kbit_core.formats.base import DecodedBatch

log = logging.getLogger(__name__)


class UnsupportedSchema(Exception):
    """The fast path was not written for this schema: the stock decoder is used, with this reason logged."""


class Defer(Exception):
    """A value the fast path leaves to the stock library (an unusual but maybe valid encoding, or garbage)."""


class FastPath:
    """Mixin: ``_decode`` through ``_fast_columns``, the stock ``_decode`` when that raises."""

    decoder = "fast"
    deferred_batches = 0  # batches the stock library decoded (or rejected) instead

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        try:
            indices, labels, pixels = self._fast_columns(values)
        except Exception as exc:  # noqa: BLE001 - anything unexpected is the stock library's to judge
            self.deferred_batches += 1
            log.debug("%s: fast path deferred %d value(s) to the stock decoder: %r", self.name, len(values), exc)
            return super()._decode(values)  # type: ignore[misc]
        return self._finish(indices, labels, pixels.reshape(len(indices), *self.image_shape))  # type: ignore[attr-defined]

    def _fast_columns(self, values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

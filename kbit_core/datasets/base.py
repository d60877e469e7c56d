"""The DatasetSource contract: a fixed-size, lazily read sequence of (index, record, label): an image uint8[C, H, W]
or a token sequence uint16[L]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import numpy as np

Samples = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(indices int64[n], records [n, *image_shape] of ``record_dtype``, labels int64[n])."""


class DatasetSource(ABC):
    """A dataset that yields its records in index order, in bounded-memory batches.

    Subclasses set ``name``, ``image_shape``, ``num_classes`` and ``num_records`` and implement
    ``_chunks``; ``batches`` checks the range and attaches the record indices. ``image_shape`` is the shape of
    one record: (C, H, W) for images, (L,) for token sequences, whose sources also set ``record_dtype`` and
    ``vocab_size``.
    """

    name: str
    image_shape: tuple[int, ...]
    num_classes: int
    num_records: int
    record_dtype: str = "uint8"
    vocab_size: int | None = None  # token sources: every id lies in [0, vocab_size)

    def batches(self, start: int = 0, stop: int | None = None, batch_size: int = 4096) -> Iterator[Samples]:
        """Yield the records ``[start, stop)`` in order, ``batch_size`` at a time (the last batch may be shorter).

        Args:
            start: First record index. Defaults to ``0``.
            stop: One past the last record index; ``None`` means ``num_records``.
            batch_size: Records per yielded batch. Defaults to ``4096``.
        """
        stop = self.num_records if stop is None else stop
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"{self.name}: range [{start}, {stop}) is outside [0, {self.num_records}]")
        if batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, got {batch_size}")
        index = start
        for images, labels in self._chunks(start, stop, batch_size):
            yield np.arange(index, index + len(labels), dtype=np.int64), images, labels
            index += len(labels)

    @abstractmethod
    def _chunks(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (records [n, *image_shape], labels int64[n]) covering the valid range ``[start, stop)`` in order,
        ``batch_size`` records each except the last."""

    def __len__(self) -> int:
        return self.num_records

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, image_shape={self.image_shape}, "
            f"num_classes={self.num_classes}, num_records={self.num_records})"
        )


def rebatch(
    chunks: Iterable[tuple[np.ndarray, np.ndarray]], batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Regroup (images, labels) chunks of any sizes into batches of exactly ``batch_size`` (the last may be shorter)."""
    images_buf: list[np.ndarray] = []
    labels_buf: list[np.ndarray] = []
    held = 0
    for images, labels in chunks:
        while len(labels):
            take = min(batch_size - held, len(labels))
            images_buf.append(images[:take])
            labels_buf.append(labels[:take])
            held += take
            images, labels = images[take:], labels[take:]
            if held == batch_size:
                yield _join(images_buf, labels_buf)
                images_buf, labels_buf, held = [], [], 0
    if held:
        yield _join(images_buf, labels_buf)


def _join(images: list[np.ndarray], labels: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if len(images) == 1:
        return images[0], labels[0]
    return np.concatenate(images), np.concatenate(labels)

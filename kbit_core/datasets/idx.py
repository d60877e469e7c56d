"""MNIST / Fashion-MNIST from IDX files (raw or gzip), validated up front and read lazily.

Raw image files are memory-mapped. Gzip image files are streamed: each ``batches`` call
decompresses the file once, forwards only, holding one batch at a time. Their length is checked by
decompressing them once up front (about 0.2 s for MNIST's 47 MB): the gzip trailer's ISIZE is only the
size mod 2**32, and a cut-off file has no trailer at all, so its last four bytes would report nonsense.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kbit_core.datasets.base import DatasetSource, rebatch
from kbit_core.errors import ConfigError, KbitError

IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension
_GZIP_CHUNK = 1 << 20
SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class IdxFormatError(KbitError):
    """An IDX file is malformed or inconsistent with its companion file."""


def find_idx_file(directory: Path, stem: str) -> Path:
    """``<stem>`` if present, else ``<stem>.gz``; a ConfigError naming both if neither exists."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"IDX file not found: neither {directory / stem} nor {directory / stem}.gz exists")


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _read_header(path: Path, magic: int) -> tuple[int, ...]:
    """Check the magic number and return the dimension sizes that follow it."""
    ndim = magic & 0xFF
    size = 4 * (1 + ndim)
    try:
        with _open(path) as f:
            head = f.read(size)
    except (OSError, EOFError) as exc:
        raise IdxFormatError(f"{path}: cannot read IDX header: {exc}") from None
    if len(head) < size:
        raise IdxFormatError(f"{path}: file too short for an IDX header ({len(head)} of {size} bytes)")
    found, *dims = struct.unpack(f">{1 + ndim}I", head)
    if found != magic:
        raise IdxFormatError(f"{path}: bad magic number {found} (0x{found:08x}), expected {magic} (0x{magic:08x})")
    return tuple(dims)


def _gzip_payload_size(path: Path) -> tuple[int, bool]:
    """Bytes the gzip file decompresses to, and whether its stream ends properly (False: the file is cut off)."""
    total = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(_GZIP_CHUNK):
                total += len(chunk)
    except gzip.BadGzipFile as exc:
        raise IdxFormatError(f"{path}: not a gzip file ({exc})") from None
    except (EOFError, zlib.error):
        return total, False
    return total, True


def _check_size(path: Path, header: int, payload: int) -> None:
    expected = header + payload
    promise = f"its header promises {expected} ({header}-byte header + {payload} bytes of data)"
    if path.suffix != ".gz":
        found = path.stat().st_size
        if found != expected:
            raise IdxFormatError(f"{path}: holds {found} bytes but {promise}; the file is truncated or padded")
        return
    found, complete = _gzip_payload_size(path)
    if not complete:
        raise IdxFormatError(
            f"{path}: the gzip stream is cut off after {found} decompressed bytes "
            f"(the {path.stat().st_size}-byte file is truncated); {promise}"
        )
    if found != expected:
        raise IdxFormatError(f"{path}: decompresses to {found} bytes but {promise}; the file is truncated or padded")


@dataclass(frozen=True)
class IdxPart:
    """One images/labels file pair, validated; labels are small and kept in memory."""

    images_path: Path
    count: int
    rows: int
    cols: int
    labels: np.ndarray

    @classmethod
    def open(cls, directory: Path, split: str, num_classes: int) -> IdxPart:
        images_stem, labels_stem = SPLIT_FILES[split]
        images_path = find_idx_file(directory, images_stem)
        labels_path = find_idx_file(directory, labels_stem)
        count, rows, cols = _read_header(images_path, IMAGES_MAGIC)
        (num_labels,) = _read_header(labels_path, LABELS_MAGIC)
        if rows == 0 or cols == 0:
            raise IdxFormatError(f"{images_path}: image dimensions {rows}x{cols} are empty")
        if count != num_labels:
            raise IdxFormatError(f"{images_path} holds {count} images but {labels_path} holds {num_labels} labels")
        _check_size(images_path, 16, count * rows * cols)
        _check_size(labels_path, 8, num_labels)
        with _open(labels_path) as f:
            f.seek(8)
            labels = np.frombuffer(f.read(), dtype=np.uint8)
        if labels.size != num_labels:
            raise IdxFormatError(f"{labels_path}: expected {num_labels} labels, read {labels.size}")
        bad = np.flatnonzero(labels >= num_classes)
        if bad.size:
            raise IdxFormatError(
                f"{labels_path}: label {labels[bad[0]]} at position {bad[0]} is outside "
                f"[0, {num_classes}) ({bad.size} such labels)"
            )
        return cls(images_path, count, rows, cols, labels)

    def read(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (images uint8[n, 1, rows, cols], labels int64[n]) for [start, stop) in batches."""
        record = self.rows * self.cols
        if self.images_path.suffix != ".gz":
            images = np.memmap(
                self.images_path, dtype=np.uint8, mode="r", offset=16, shape=(self.count, 1, self.rows, self.cols)
            )
            for lo in range(start, stop, batch_size):
                hi = min(lo + batch_size, stop)
                yield np.array(images[lo:hi]), self.labels[lo:hi].astype(np.int64)
            return
        with gzip.open(self.images_path, "rb") as f:
            f.seek(16 + start * record)
            for lo in range(start, stop, batch_size):
                hi = min(lo + batch_size, stop)
                chunk = f.read((hi - lo) * record)
                if len(chunk) != (hi - lo) * record:
                    raise IdxFormatError(f"{self.images_path}: truncated at image {lo + len(chunk) // record}")
                images = np.frombuffer(chunk, dtype=np.uint8).reshape(hi - lo, 1, self.rows, self.cols)
                yield images, self.labels[lo:hi].astype(np.int64)


class IdxSource(DatasetSource):
    """MNIST-format IDX files in a directory; ``split='all'`` is train followed by test."""

    num_classes = 10

    def __init__(self, name: str, directory: Path, split: str, num_records: int | None) -> None:
        if not directory.is_dir():
            raise ConfigError(f"dataset {name!r}: dataset.path {directory} is not a directory")
        self.name = name
        splits = ("train", "test") if split == "all" else (split,)
        self._parts = [IdxPart.open(directory, s, self.num_classes) for s in splits]
        shapes = {(p.rows, p.cols) for p in self._parts}
        if len(shapes) > 1:
            raise IdxFormatError(f"{directory}: train and test images differ in size: {sorted(shapes)}")
        rows, cols = shapes.pop()
        self.image_shape = (1, rows, cols)
        total = sum(p.count for p in self._parts)
        if total == 0:
            raise IdxFormatError(f"{directory}: the {split} IDX files hold no images")
        self.num_records = total if num_records is None else min(num_records, total)

    def _chunks(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return rebatch(self._part_chunks(start, stop, batch_size), batch_size)

    def _part_chunks(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        offset = 0
        for part in self._parts:
            lo, hi = max(start - offset, 0), min(stop - offset, part.count)
            offset += part.count
            if lo < hi:
                yield from part.read(lo, hi, batch_size)

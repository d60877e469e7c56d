"""One partition's fetched records as columns over one buffer: a sequence of records to code that walks them, whole
arrays (offsets, value lengths, the values joined) to code that does not."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from kbit_core.kafka.consumers import MessageRecord, RawRecord
from kbit_core.kafka.record_batches import RecordFields, read_headers


class ValueColumn(Sequence[bytes | None]):
    """Values of records in one buffer. Item access slices ``bytes`` (``None`` for a null value); ``lengths``,
    :meth:`joined` and :meth:`matrix` make no object per value."""

    def __init__(self, buffer: bytes, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.buffer, self.starts, self.lengths = buffer, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, index: int) -> bytes | None: ...
    @overload
    def __getitem__(self, index: slice | np.ndarray) -> ValueColumn: ...
    def __getitem__(self, index: int | slice | np.ndarray) -> Any:
        if isinstance(index, slice | np.ndarray):
            return ValueColumn(self.buffer, self.starts[index], self.lengths[index])
        start, length = int(self.starts[index]), int(self.lengths[index])
        return None if length < 0 else self.buffer[start : start + length]

    def __iter__(self) -> Iterator[bytes | None]:
        if (self.lengths >= 0).all():
            ends = self.starts + self.lengths
            return map(self.buffer.__getitem__, map(slice, self.starts.tolist(), ends.tolist()))
        return (self[i] for i in range(len(self)))

    def matrix(self) -> np.ndarray | None:
        """The values as rows of a uint8 matrix when they are all equally long (as a producer's fixed-size records
        are); otherwise None. Rows equally spaced in the buffer are a view of it, others are gathered in one copy."""
        count = len(self.starts)
        if not count or self.lengths[0] < 0 or (self.lengths != self.lengths[0]).any():
            return None
        width, data = int(self.lengths[0]), np.frombuffer(self.buffer, np.uint8)
        first = int(self.starts[0])
        stride = int(self.starts[1]) - first if count > 1 else width
        if count == 1 or (np.diff(self.starts) == stride).all():
            shape, strides = (count, width), (stride, 1)
            return np.lib.stride_tricks.as_strided(data[first:], shape=shape, strides=strides, writeable=False)
        return np.lib.stride_tricks.sliding_window_view(data, width)[self.starts]

    def joined(self) -> bytes:
        """Every value, concatenated (nulls add nothing)."""
        rows = self.matrix()
        return rows.tobytes() if rows is not None else b"".join(filter(None, self))


class RecordColumns(Sequence[RawRecord]):
    """Records of one partition fetched together: their offsets and where their keys and values lie in ``buffer``.
    Indexing gives a :class:`RawRecord` (a :class:`MessageRecord` with ``metadata``), slicing more columns."""

    def __init__(self, partition: int, buffer: bytes, fields: RecordFields, metadata: bool = False) -> None:
        self.partition, self.buffer, self.fields, self.metadata = partition, buffer, fields, metadata

    @property
    def offsets(self) -> np.ndarray:
        return self.fields.offsets

    @property
    def values(self) -> ValueColumn:
        return ValueColumn(self.buffer, self.fields.value_starts, self.fields.value_lengths)

    @property
    def value_bytes(self) -> int:
        return int(np.maximum(self.fields.value_lengths, 0).sum())

    def __len__(self) -> int:
        return len(self.fields.offsets)

    @overload
    def __getitem__(self, index: int) -> RawRecord: ...
    @overload
    def __getitem__(self, index: slice) -> RecordColumns: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            sliced = RecordFields(*(column[index] for column in vars(self.fields).values()))
            return RecordColumns(self.partition, self.buffer, sliced, self.metadata)
        index = range(len(self))[index]
        record = (self.partition, int(self.fields.offsets[index]), self.values[index])
        if not self.metadata:
            return RawRecord(*record)
        return MessageRecord(*record, self._key(index), self._headers(index), int(self.fields.timestamps[index]))

    def _key(self, index: int) -> bytes | None:
        start, length = int(self.fields.key_starts[index]), int(self.fields.key_lengths[index])
        return None if length < 0 else self.buffer[start : start + length]

    def _headers(self, index: int) -> list[tuple[str, bytes | None]] | None:
        count = int(self.fields.header_counts[index])
        return read_headers(self.buffer, int(self.fields.header_starts[index]), count) if count else None

    @classmethod
    def concat(cls, parts: Sequence[RecordColumns]) -> RecordColumns:
        """One set of columns holding ``parts`` in order (of one partition): the bytes of their records, and only
        those (a fetch's buffer also holds what other ranges read), joined, their positions moved."""
        if len(parts) == 1:
            return parts[0]
        pieces, shifted, size = [], [], 0
        for part in parts:
            fields = part.fields
            first, end = (int(fields.record_starts[0]), int(fields.record_ends[-1])) if len(part) else (0, 0)
            moved = {
                name: column + (size - first) if name.endswith("_starts") or name == "record_ends" else column
                for name, column in vars(fields).items()
            }
            pieces.append(memoryview(part.buffer)[first:end])
            shifted.append(moved)
            size += end - first
        fields = RecordFields(**{name: np.concatenate([m[name] for m in shifted]) for name in shifted[0]})
        return cls(parts[0].partition, b"".join(pieces), fields, parts[0].metadata)

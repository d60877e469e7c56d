"""A Codec over a user's records: a RecordDecoder's columns turned into (features, label) by a mapping.

The records carry no kbit index: a sample's index is its position in the snapshot (partition by partition,
offset by offset), set by the reader from each record's partition and offset (:meth:`MappedCodec.indexed`), so
gap checks, resume and the exactly-once audit see the same indices as on kbit's own topics. A mapping that names a
message's key, a header or its timestamp (@key, @header.NAME, @timestamp) has the codec decode whole records instead
of values (``reads_metadata``). kbit never writes such a topic, so this codec does not encode.
"""

from __future__ import annotations

import binascii
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kbit_core.config import MappingConfig
from kbit_core.errors import CorruptRecordError
from kbit_core.formats.base import Codec, DecodedBatch, canonical_json
from kbit_core.formats.message_fields import message_columns, message_fields
from kbit_core.formats.records import Column, RecordDecoder

_INTEGER_LIMITS = {"uint8": (0, 255), "uint16": (0, 65535)}


class NullFieldSkipped(ValueError):
    """A record with a null mapped field, under ``nulls: skip``: the reader skips and counts it."""


class MappedCodec(Codec):
    """Decodes a user's message values with ``decoder`` and maps their fields to a DecodedBatch.

    ``partition_starts`` is ``{partition: (first offset, index of that offset's record)}`` of the snapshot.
    """

    format = "mapped"
    index_from_offsets = True

    def __init__(
        self,
        decoder: RecordDecoder,
        mapping: MappingConfig,
        partition_starts: Mapping[int, tuple[int, int]],
        *,
        vocabulary: Sequence[str] | None = None,
        num_classes: int | None = None,
    ) -> None:
        self.decoder, self.mapping = decoder, mapping
        self.partition_starts = dict(partition_starts)
        self.vocabulary = list(vocabulary) if vocabulary is not None else None
        self._classes = {name: i for i, name in enumerate(self.vocabulary or ())}
        self.layout = "list" if mapping.dtype == "float32" else "bytes"
        self.image_shape = tuple(mapping.record_shape)  # type: ignore[assignment]
        self.records_per_message = 1
        self.num_classes = num_classes
        self.record_size = int(np.prod(self.image_shape))
        self.dtype = np.dtype(mapping.dtype).newbyteorder("<")
        self.record_bytes = self.record_size * self.dtype.itemsize
        self.reads_metadata = mapping.reads_metadata
        self._value_fields = mapping.value_fields
        self._message_fields = message_fields(mapping)
        partitions = max(self.partition_starts, default=-1) + 1
        self._first = np.zeros(partitions, np.int64)
        self._base = np.zeros(partitions, np.int64)
        for partition, (first, base) in self.partition_starts.items():
            self._first[partition], self._base[partition] = first, base

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (self.decoder, self.mapping, self.partition_starts, self.vocabulary, self.num_classes)

    @property
    def name(self) -> str:
        return "mapped"

    def _encode(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> list[bytes]:
        raise TypeError("kbit never writes a topic it did not create; a mapped topic is read only")

    def skips(self, reason: BaseException) -> bool:
        """Whether a value failing with ``reason`` is skipped and counted whatever reader.bad_records says."""
        return isinstance(reason, NullFieldSkipped)

    # ---- decode -------------------------------------------------------------------------------

    def _decode(self, values: Sequence[Any]) -> DecodedBatch:
        """``values``: message values, or records with key, headers and timestamp when ``reads_metadata``."""
        records, values = (values, [r.value for r in values]) if self.reads_metadata else ((), values)
        columns: dict[str, Column] = {}
        if self._value_fields:
            if any(v is None for v in values):
                raise ValueError("the message has no value (null)")
            columns = self.decoder.decode_columns(values, self._value_fields)
        if self.reads_metadata:
            columns.update(message_columns(records, self._message_fields, self.mapping))
        labels = self._labels(columns[self.mapping.label])
        pixels = self._features([columns[path] for path in self.mapping.features], len(values))
        self._check_labels(labels, "decode")
        return DecodedBatch(np.zeros(len(values), np.int64), labels, pixels)

    def indexed(self, batch: DecodedBatch, records: Sequence[Any]) -> DecodedBatch:
        """``batch`` with each sample's index set from its record's (partition, offset): its snapshot position."""
        count = len(records)
        partitions = np.fromiter(map(operator.itemgetter(0), records), np.int64, count)
        offsets = np.fromiter(map(operator.itemgetter(1), records), np.int64, count)
        indices = self._base[partitions] + offsets - self._first[partitions]
        return DecodedBatch(indices, batch.labels, batch.pixels)

    def _labels(self, column: Column) -> np.ndarray:
        path = self.mapping.label
        if isinstance(column, np.ndarray):
            return column.astype(np.int64)
        position = next((i for i, v in enumerate(column) if v is None), None)
        if position is not None:
            raise ValueError(f"record {position}: the label field {path!r} is null or missing")
        if self.vocabulary is not None:
            try:
                return np.fromiter(map(self._classes.__getitem__, column), np.int64, len(column))
            except (KeyError, TypeError):
                bad = next(v for v in column if not isinstance(v, str) or v not in self._classes)
                raise ValueError(f"label {bad!r} of field {path!r} is not in the vocabulary") from None
        bad = next((v for v in column if type(v) is not int), None)
        if bad is not None:
            raise ValueError(f"the label field {path!r} must be an integer, got {type(bad).__name__} {bad!r}")
        return np.fromiter(column, np.int64, len(column))

    def _features(self, columns: list[Column], count: int) -> np.ndarray:
        columns = [self._nulls_filled(path, column) for path, column in zip(self.mapping.features, columns)]
        if len(columns) > 1:
            stacked = np.column_stack([self._numbers(path, c) for path, c in zip(self.mapping.features, columns)])
        elif self.mapping.encoding == "array":
            stacked = self._numbers(self.mapping.features[0], columns[0])
        else:
            stacked = self._from_bytes(columns[0])
        if stacked.size != count * self.record_size:
            per_record = stacked.size // max(count, 1)
            raise ValueError(
                f"a record's features hold {per_record} values, source.mapping.shape {list(self.image_shape)} "
                f"needs {self.record_size}"
            )
        return stacked.reshape(count, *self.image_shape)

    def _nulls_filled(self, path: str, column: Column) -> Column:
        if isinstance(column, np.ndarray) or all(v is not None for v in column):
            return column
        if self.mapping.nulls == "fill":
            fill = self.mapping.fill if len(self.mapping.features) > 1 else [self.mapping.fill] * self.record_size
            return [fill if v is None else v for v in column]
        error = NullFieldSkipped if self.mapping.nulls == "skip" else ValueError
        raise error(f"the feature field {path!r} is null or missing (source.mapping.nulls: {self.mapping.nulls})")

    def _numbers(self, path: str, column: Column) -> np.ndarray:
        """A column of numbers or of number arrays as the mapping's dtype, refusing other types and lost values."""
        try:
            array = np.asarray(column)
        except ValueError:
            raise ValueError(f"field {path!r} holds arrays of different lengths") from None
        if array.dtype.kind not in "iuf" or array.dtype == np.bool_:
            raise ValueError(f"field {path!r} must hold numbers, got {array.dtype.name} values")
        limits = _INTEGER_LIMITS.get(self.mapping.dtype)
        if limits is not None and array.size:
            if array.dtype.kind == "f" and not np.array_equal(array, np.round(array)):
                raise ValueError(f"field {path!r} holds fractions; source.mapping.dtype is {self.mapping.dtype}")
            if array.min() < limits[0] or array.max() > limits[1]:
                raise ValueError(f"field {path!r} holds values outside {self.mapping.dtype}'s range {list(limits)}")
        return array.astype(self.dtype)

    def _from_bytes(self, column: Column) -> np.ndarray:
        path = self.mapping.features[0]
        if self.mapping.encoding == "base64":
            if not all(isinstance(v, str) for v in column):
                raise ValueError(f"field {path!r} must hold base64 text")
            try:
                column = [binascii.a2b_base64(v, strict_mode=True) for v in column]
            except binascii.Error as exc:
                raise ValueError(f"field {path!r} is not base64: {exc}") from None
        elif not all(isinstance(v, bytes | bytearray) for v in column):
            raise ValueError(f"field {path!r} must hold bytes")
        if any(len(v) != self.record_bytes for v in column):
            size = next(len(v) for v in column if len(v) != self.record_bytes)
            raise ValueError(f"field {path!r} holds {size} bytes, source.mapping.shape needs {self.record_bytes}")
        return np.frombuffer(b"".join(column), self.dtype)

    def corrupt_value_error(self, position: int, total: int, value: Any, reason: object) -> CorruptRecordError:
        value = value.value if isinstance(value, tuple) else value  # a record with key, headers and timestamp
        size = "null" if value is None else f"{len(value)} bytes"
        return CorruptRecordError(f"value {position} of {total} ({size}) does not fit source.mapping: {reason}")

    def _definition(self) -> str:
        return canonical_json(
            {
                "decoder": type(self.decoder).__name__,
                # the formats of key and headers count only where read, so older snapshots keep their fingerprints
                "mapping": self.mapping.model_dump(
                    mode="json", exclude=set() if self.reads_metadata else {"key_format", "header_format"}
                ),
                "vocabulary": self.vocabulary,
                "num_classes": self.num_classes,
            }
        )


def _rebuild(
    decoder: RecordDecoder,
    mapping: MappingConfig,
    partition_starts: Mapping[int, tuple[int, int]],
    vocabulary: Sequence[str] | None,
    num_classes: int | None,
) -> MappedCodec:
    return MappedCodec(decoder, mapping, partition_starts, vocabulary=vocabulary, num_classes=num_classes)

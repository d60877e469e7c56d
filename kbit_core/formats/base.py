"""The Codec contract: samples <-> Kafka message values, with strict decoding and a schema fingerprint.

A codec turns ``(indices, images uint8[n, C, H, W], labels)`` into one value per Kafka message
(``records_per_message`` samples each, the last group possibly shorter) and back. The ``list``
layout carries pixels as floats in [0, 1] (the original DDP_KBIT payload); ``bytes`` carries the
packed uint8 pixels. Decoding is all-or-nothing: any malformed value raises CorruptRecordError.

Records need not be images: a codec takes any record shape of one to three sizes and, in the ``bytes``
layout of the formats that set ``wide_records``, uint16 elements (token ids), sent little-endian.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any, ClassVar

import numpy as np

from kbit_core.errors import ConfigError, CorruptRecordError, SchemaRegistryError

LAYOUTS = ("list", "bytes")
_VALUE = operator.attrgetter("value")
RECORD_DTYPES = ("uint8", "uint16")


@dataclass(frozen=True)
class DecodedBatch:
    """Decoded samples: ``pixels`` is float32 in [0, 1] (``list`` layout) or the record dtype (``bytes``: uint8,
    or uint16 token ids), shaped [n, *image_shape]."""

    indices: np.ndarray
    labels: np.ndarray
    pixels: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Columns:
    """Per-record fields gathered while decoding, turned into arrays once per batch."""

    indices: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    pixels: list[Any] = field(default_factory=list)

    def add(self, index: int, label: int, pixels: Any) -> None:
        self.indices.append(index)
        self.labels.append(label)
        self.pixels.append(pixels)


class Codec(ABC):
    """One serialization format in one pixel layout, for one record shape and element type.

    Subclasses set ``format`` and implement ``_encode``, ``_decode`` and ``_definition``; formats
    parsed record by record derive from ``RecordCodec`` instead. Those whose bytes layout carries records of
    wider elements than uint8 set ``wide_records``.
    """

    format: ClassVar[str]
    layouts: ClassVar[tuple[str, ...]] = LAYOUTS
    unsupported_layout_reason: ClassVar[str] = ""
    max_records_per_message: ClassVar[int | None] = None
    single_record_reason: ClassVar[str] = ""
    wide_records: ClassVar[bool] = False
    # Records carry no index of their own: the reader sets each sample's index from its (partition, offset) with
    # ``indexed(batch, records)`` (a user's topic, see formats/mapping.py).
    index_from_offsets: ClassVar[bool] = False
    # decode takes whole records (with key, headers and timestamp: kafka.consumers.MessageRecord) instead of their
    # values: a mapping that reads a message's key, a header or its timestamp (formats/mapping.py). The reader's
    # consumer carries them only then.
    reads_metadata: bool = False

    def __init__(
        self,
        layout: str,
        image_shape: Sequence[int],
        records_per_message: int = 1,
        *,
        num_classes: int | None = None,
        dtype: str = "uint8",
    ) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown pixel layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        if layout not in self.layouts:
            raise ConfigError(f"format {self.format!r} has no {layout!r} layout: {self.unsupported_layout_reason}")
        if not 1 <= len(image_shape) <= 3 or any(int(d) < 1 for d in image_shape):
            raise ConfigError(f"a record's shape must be one to three positive sizes, got {tuple(image_shape)}")
        self._check_dtype(layout, dtype)
        if records_per_message < 1:
            raise ConfigError(f"records_per_message must be >= 1, got {records_per_message}")
        if self.max_records_per_message is not None and records_per_message > self.max_records_per_message:
            raise ConfigError(
                f"format {self.format!r} takes at most {self.max_records_per_message} record(s) per "
                f"message, got {records_per_message}: {self.single_record_reason}"
            )
        if num_classes is not None and num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
        self.layout = layout
        self.image_shape: tuple[int, int, int] = tuple(int(d) for d in image_shape)  # type: ignore[assignment]
        self.records_per_message = records_per_message
        self.num_classes = num_classes
        self.record_size = int(np.prod(self.image_shape))
        self.dtype = np.dtype(dtype).newbyteorder("<")  # wide elements travel little-endian
        self.record_bytes = self.record_size * self.dtype.itemsize

    def _check_dtype(self, layout: str, dtype: str) -> None:
        if dtype not in RECORD_DTYPES:
            raise ConfigError(f"records of {dtype} cannot be sent; kbit's codecs carry {', '.join(RECORD_DTYPES)}")
        if dtype == "uint8":
            return
        if layout == "list":
            raise ConfigError(
                f"{self.format}/list carries pixels as floats in [0, 1]; {dtype} records (token ids) need layout 'bytes'"
            )
        if not self.wide_records:
            raise ConfigError(
                f"{self.format}/bytes carries uint8 pixels only; {dtype} records (token ids) travel in raw or "
                "protobuf, layout 'bytes'"
            )

    @property
    def name(self) -> str:
        base = f"{self.format}/{self.layout}"
        return base if self.records_per_message == 1 else f"{base}/x{self.records_per_message}"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its class and the arguments that build it again (for decode worker processes): a fast codec
        holds code it generated from the schema, which does not pickle."""
        return functools.partial(type(self), num_classes=self.num_classes, dtype=self.dtype.name), (
            self.layout,
            self.image_shape,
            self.records_per_message,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name}, image_shape={self.image_shape}, dtype={self.dtype.name}, "
            f"num_classes={self.num_classes})"
        )

    # ---- encode -------------------------------------------------------------------------------

    def encode(self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray) -> list[bytes]:
        """Serialize samples into Kafka message values, ``records_per_message`` samples per value.

        Args:
            indices: int[n] sample indices (>= 0).
            images: [n, *image_shape] records of the codec's dtype (uint8 pixels, uint16 token ids).
            labels: int[n] class labels.

        Returns:
            ``ceil(n / records_per_message)`` values, in sample order.
        """
        return self._encode(*self._prepared(indices, images, labels))

    def _prepared(self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, ...]:
        """Checked ``(indices, labels, pixels [n, C*H*W])``, pixels as floats in [0, 1] for the list layout."""
        indices, images, labels = self._check_inputs(indices, images, labels)
        pixels = images.reshape(len(images), self.record_size)
        if self.layout == "list":
            pixels = pixels.astype(np.float32) / np.float32(255)
        return indices, labels, pixels

    @abstractmethod
    def _encode(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> list[bytes]:
        """Message values for checked samples; ``pixels`` is [n, C*H*W], float32 in [0, 1] (list layout)
        or uint8 (bytes layout)."""

    def _check_inputs(
        self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        indices, images, labels = np.asarray(indices), np.asarray(images), np.asarray(labels)
        if images.dtype != self.dtype:
            raise ValueError(f"{self.name}: records must be {self.dtype.name}, got {images.dtype}")
        if images.shape[1:] != self.image_shape:
            raise ValueError(f"{self.name}: images have shape {images.shape}, expected (n, *{self.image_shape})")
        n = len(images)
        if indices.shape != (n,) or labels.shape != (n,):
            raise ValueError(
                f"{self.name}: need one index and one label per image: indices {indices.shape}, "
                f"labels {labels.shape}, images {images.shape}"
            )
        if not (np.issubdtype(indices.dtype, np.integer) and np.issubdtype(labels.dtype, np.integer)):
            raise ValueError(f"{self.name}: indices and labels must be integers, got {indices.dtype}, {labels.dtype}")
        if n and indices.min() < 0:
            raise ValueError(f"{self.name}: negative sample index {indices.min()}")
        self._check_labels(labels, "encode")
        return indices.astype(np.int64), np.ascontiguousarray(images, dtype=self.dtype), labels.astype(np.int64)

    def _check_labels(self, labels: np.ndarray, where: str) -> None:
        hi = self.num_classes
        bad = np.flatnonzero((labels < 0) | (labels >= hi)) if hi is not None else np.flatnonzero(labels < 0)
        if bad.size:
            allowed = f"[0, {hi})" if hi is not None else ">= 0"
            raise ValueError(f"{self.name} {where}: label {labels[bad[0]]} of record {bad[0]} is not {allowed}")

    # ---- decode -------------------------------------------------------------------------------

    def decode_inputs(self, records: Sequence[Any]) -> Sequence[Any]:
        """What :meth:`decode` takes of polled ``records``: their values (a fetched column's own value column, which
        makes no object per value until one is asked for), or the records themselves when the codec reads message
        metadata."""
        if self.reads_metadata:
            return records
        column = getattr(records, "values", None)
        return column if column is not None else list(map(_VALUE, records))

    def decode(self, values: Sequence[bytes]) -> DecodedBatch:
        """Decode message values into one batch, or raise CorruptRecordError; never returns partial data."""
        try:
            return self._decode(values)
        except SchemaRegistryError:
            raise  # the registry's fault, never a value's: nothing to localise
        except Exception as exc:  # noqa: BLE001 - each library raises its own types for malformed input
            raise self._localise(values, exc) from exc

    @abstractmethod
    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        """Decode and validate a batch of values, raising on anything unexpected."""

    def failing_values(self, values: Sequence[bytes]) -> Iterator[tuple[int, Exception]]:
        """Decode each value on its own; (position, error) of each one that fails. How a batch that failed is
        localised, here (the first culprit names the error) and by the reader (which skips every culprit)."""
        for position, value in enumerate(values):
            try:
                self._decode([value])
            except SchemaRegistryError:
                raise  # as in decode: no value is to blame
            except Exception as exc:  # noqa: BLE001 - as in decode
                yield position, exc

    def skips(self, reason: BaseException) -> bool:
        """Whether a value failing with ``reason`` is skipped and counted whatever ``reader.bad_records`` says."""
        return False

    def _localise(self, values: Sequence[bytes], batch_error: Exception) -> CorruptRecordError:
        """Find the first value that fails on its own, so the error names it (the batch path stays lean)."""
        for position, exc in self.failing_values(values):
            return self.corrupt_value_error(position, len(values), values[position], exc)
        return CorruptRecordError(f"{self.name}: cannot decode {len(values)} values: {batch_error}")

    def corrupt_value_error(self, position: int, total: int, value: bytes | None, reason: object) -> CorruptRecordError:
        size = "null" if value is None else f"{len(value)} bytes"
        return CorruptRecordError(f"{self.name}: cannot decode value {position} of {total} ({size}): {reason}")

    def _check_shape(self, shape: Sequence[int]) -> None:
        if list(shape) != list(self.image_shape):
            raise ValueError(f"shape {list(shape)} does not match the codec's image shape {list(self.image_shape)}")

    def _finish(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> DecodedBatch:
        """Validate decoded columns (index >= 0, label range, float pixels in [0, 1]) into a DecodedBatch."""
        if indices.size and indices.min() < 0:
            raise ValueError(f"record {int(np.argmin(indices))} has negative index {indices.min()}")
        self._check_labels(labels, "decode")
        if (
            self.layout == "list"
            and pixels.size
            and not (np.isfinite(pixels).all() and pixels.min() >= 0 and pixels.max() <= 1)
        ):
            raise ValueError("float pixels outside [0, 1] or not finite")
        return DecodedBatch(indices, labels, pixels)

    # ---- schema -------------------------------------------------------------------------------

    @abstractmethod
    def _definition(self) -> str:
        """Canonical text of the record schema (Avro canonical form, protobuf descriptor, field spec...)."""

    @cached_property
    def _fingerprint(self) -> str:
        spec = {
            "format": self.format,
            "layout": self.layout,
            "records_per_message": self.records_per_message,
            "image_shape": list(self.image_shape),
            "definition": self._definition(),
        }
        if self.dtype != np.uint8:  # so image fingerprints stay what they were before records had a dtype
            spec["dtype"] = self.dtype.name
        return hashlib.sha256(canonical_json(spec).encode()).hexdigest()

    def schema_fingerprint(self) -> str:
        """sha256 (hex) of the format, layout, grouping, image shape and canonical schema: equal fingerprints
        mean the same record contract."""
        return self._fingerprint


class RecordCodec(Codec):
    """A codec whose library parses message values into per-record objects.

    Subclasses implement ``_encode_group`` (one value), ``_parse_one`` (a single-record value),
    ``_parse_many`` (a multi-record value) and ``_columns`` (fields of parsed records, checked);
    arrays are built once per batch.
    """

    def _encode(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> list[bytes]:
        step = self.records_per_message
        return [
            self._encode_group(indices[i : i + step], labels[i : i + step], pixels[i : i + step])
            for i in range(0, len(indices), step)
        ]

    @abstractmethod
    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        """One message value for up to ``records_per_message`` samples."""

    def encode_objects(self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray) -> list[Any]:
        """What ``encode`` serializes, one object per message value (an Avro record dict, a Protobuf message, a JSON
        document): for a schema-registry serializer to write instead (``formats.confluent.framed``)."""
        indices, labels, pixels = self._prepared(indices, images, labels)
        step = self.records_per_message
        return [
            self._group_object(indices[i : i + step], labels[i : i + step], pixels[i : i + step])
            for i in range(0, len(indices), step)
        ]

    def _group_object(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> Any:
        """The object one value holds, for formats a schema-registry serializer writes."""
        raise NotImplementedError(f"{self.name} has no serializer-ready objects")

    def _decode(self, values: Sequence[bytes]) -> DecodedBatch:
        if self.records_per_message == 1:
            records = list(map(self._parse_one, values))
        else:
            records = [r for v in values for r in self._group(self._parse_many(v))]
        return self._assemble(self._columns(records))

    @abstractmethod
    def _parse_one(self, value: bytes) -> Any:
        """The record in a single-record value."""

    @abstractmethod
    def _parse_many(self, value: bytes) -> Sequence[Any]:
        """The records in a multi-record value."""

    @abstractmethod
    def _columns(self, records: Sequence[Any]) -> Columns:
        """Index, label and pixel payload of every record, after checking its shape and field types."""

    def _group(self, records: Sequence[Any]) -> Sequence[Any]:
        """The records of a multi-record value, checked to number 1..records_per_message."""
        if not 1 <= len(records) <= self.records_per_message:
            raise ValueError(f"value holds {len(records)} records, expected 1..{self.records_per_message}")
        return records

    def _assemble(self, columns: Columns) -> DecodedBatch:
        n, size = len(columns.indices), self.record_size
        if self.layout == "bytes":
            size = self.record_bytes
        if not set(map(len, columns.pixels)) <= {size}:
            position, length = next((i, len(c)) for i, c in enumerate(columns.pixels) if len(c) != size)
            unit = "pixel values" if self.dtype == np.uint8 or self.layout == "list" else "bytes"
            raise ValueError(f"record {position} has {length} {unit}, expected {size}")
        if self.layout == "bytes":
            pixels = np.frombuffer(bytearray().join(columns.pixels), dtype=self.dtype)
        else:
            pixels = np.fromiter(chain.from_iterable(columns.pixels), dtype=np.float32, count=n * size)
        return self._finish(
            np.array(columns.indices, dtype=np.int64),
            np.array(columns.labels, dtype=np.int64),
            pixels.reshape(n, *self.image_shape),
        )


def value_lengths(values: Sequence[bytes]) -> np.ndarray:
    """Each value's length: a fetched value column (``kbit_core.kafka.record_columns.ValueColumn``) has them as an
    array, so no value is sliced out to be measured."""
    lengths = getattr(values, "lengths", None)
    return lengths if lengths is not None else np.fromiter(map(len, values), dtype=np.int64, count=len(values))


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free JSON: the canonical text of field specs used in fingerprints."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def int_field(doc: dict[str, Any], name: str) -> int:
    """An integer field of a schemaless document (JSON, BSON), refusing bools, floats and strings."""
    value = required(doc, name)
    if type(value) is bool or not isinstance(value, int):
        raise ValueError(f"field {name!r} must be an integer, got {type(value).__name__}")
    return value


def required(doc: Any, name: str) -> Any:
    if not isinstance(doc, dict):
        raise ValueError(f"expected an object with field {name!r}, got {type(doc).__name__}")
    try:
        return doc[name]
    except KeyError:
        raise ValueError(f"missing field {name!r}") from None

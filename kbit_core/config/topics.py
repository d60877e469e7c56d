"""A topic kbit did not write, as a dataset: which topic and offsets (source) and how a record becomes tensors
(source.mapping)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, model_validator

from kbit_core.config.base import Section

# What a mapped feature becomes on a rank: uint8 pixels (scaled to [0, 1] there), uint16 token ids, or floats.
FeatureDtype = Literal["uint8", "uint16", "float32"]
# How a message key's or header's bytes are read: raw bytes, UTF-8 text, a decimal integer in UTF-8 text, or a
# big-endian two's complement integer of 4 or 8 bytes (Kafka's IntegerSerializer, LongSerializer).
KeyFormat = Literal["bytes", "string", "int", "int32", "int64"]

# Mapped paths that name a message's metadata instead of a field of its value (formats/message_fields.py).
KEY_FIELD, TIMESTAMP_FIELD, HEADER_FIELD = "@key", "@timestamp", "@header."


def is_message_field(path: str) -> bool:
    """Whether ``path`` names the message's key, a header or its timestamp rather than a field of its value."""
    return path.startswith("@")


def _check_message_field(path: str) -> None:
    if path in (KEY_FIELD, TIMESTAMP_FIELD) or (path.startswith(HEADER_FIELD) and len(path) > len(HEADER_FIELD)):
        return
    raise ValueError(f"source.mapping: field {path!r} names no part of a message; use @key, @timestamp or @header.NAME")


class MappingConfig(Section):
    """How one record of a user's topic becomes (features, label): fields named by dotted path."""

    features: list[str] = Field(
        default_factory=list,
        min_length=1,
        description="Dotted paths of the feature fields. One path: a bytes field (raw or base64 text, per "
        "source.mapping.encoding) or an array of numbers, reshaped to source.mapping.shape; several paths: scalar "
        "fields stacked in this order (shape [n]). @key, @timestamp (ms since the epoch) and @header.NAME name the "
        "message's key, timestamp and a header instead of a field of its value.",
    )
    encoding: Literal["array", "bytes", "base64"] = Field(
        "array",
        description="One feature field: an array of numbers (array), raw bytes (bytes: a binary field of Avro or "
        "Protobuf) or base64 text of the bytes (base64: how JSON carries bytes). Bytes are read as "
        "source.mapping.dtype, little-endian.",
    )
    shape: tuple[int, ...] | None = Field(
        None,
        description="One record's feature shape, e.g. [1, 28, 28]; None: [number of feature paths] for stacked "
        "scalars (required for a single array or bytes field).",
    )
    dtype: FeatureDtype = Field(
        "float32", description="uint8 (pixels, scaled to [0, 1] on the rank), uint16 (token ids) or float32."
    )
    label: str = Field(
        description="Dotted path of the label: an integer field, or a string field (see vocabulary); or @key, "
        "@header.NAME."
    )
    vocabulary: list[str] | None = Field(
        None,
        description="String labels: class i is vocabulary[i]. None with string labels: discovered when the "
        "snapshot is taken (the sorted distinct labels of its records) and kept in the manifest.",
    )
    num_classes: int | None = Field(
        None, ge=2, description="Integer labels lie in [0, num_classes); None: the vocabulary's size, or discovered."
    )
    nulls: Literal["error", "skip", "fill"] = Field(
        "error",
        description="A mapped field that is null or missing: error (a bad record: it fails the run or, with "
        "reader.bad_records: skip, is skipped and counted), skip (always skipped and counted) or fill (features "
        "take source.mapping.fill; a null label is still an error).",
    )
    fill: float = Field(0.0, description="nulls: fill: the value a null feature takes.")
    key_format: KeyFormat = Field(
        "string",
        description="How @key's bytes are read: bytes, string (UTF-8), int (a decimal integer as UTF-8 text), int32 "
        "or int64 (big-endian, as Kafka's IntegerSerializer and LongSerializer write them).",
    )
    header_format: KeyFormat = Field("string", description="How @header.NAME's bytes are read (as key_format).")

    @model_validator(mode="after")
    def _shape_of_one_field(self) -> MappingConfig:
        for path in (*self.features, self.label):
            if is_message_field(path):
                _check_message_field(path)
        if len(self.features) == 1 and self.shape is None and self.encoding != "array":
            raise ValueError(f"source.mapping.shape is needed for the {self.encoding} field {self.features[0]!r}")
        if len(self.features) > 1 and self.encoding != "array":
            raise ValueError("several feature paths are stacked scalars: source.mapping.encoding must be 'array'")
        if self.vocabulary is not None and len(set(self.vocabulary)) != len(self.vocabulary):
            raise ValueError("source.mapping.vocabulary repeats a label")
        return self

    @property
    def record_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (len(self.features),)

    @property
    def reads_metadata(self) -> bool:
        """Whether a mapped field is a message's key, header or timestamp: the consumer must carry them."""
        return any(map(is_message_field, (*self.features, self.label)))

    @property
    def value_fields(self) -> list[str]:
        """The mapped paths into the message's value, in order (features, then the label)."""
        return [path for path in (*self.features, self.label) if not is_message_field(path)]


class SourceConfig(Section):
    """A topic kbit did not write, trained on as it is: snapshotted into a manifest, never deleted or written."""

    topic: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,249}$",
        description="A topic kbit did not create: train, bench-data and bench read it (its snapshot) instead of "
        "producing a dataset. kbit never deletes, recreates or writes it.",
    )
    value_format: str = Field(
        "json", description="How message values are decoded: a name in kbit_core.formats.decoders.RECORD_DECODERS."
    )
    value_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Arguments for the value format's decoder (kept in the manifest: no secrets here).",
    )
    at: datetime | None = Field(
        None,
        description="Snapshot the records before this time (each partition's offset for the time); None: every "
        "record stored now.",
    )
    ranges: list[str] | None = Field(
        None, description="Explicit inclusive 'partition:first:last' offset ranges (every partition listed)."
    )
    snapshot: Literal["reuse", "new"] = Field(
        "reuse",
        description="reuse: the snapshot saved in the workdir for this topic, when there is one and it asked for "
        "the same offsets; new: take it again now.",
    )
    mapping: MappingConfig | None = None

    @model_validator(mode="after")
    def _one_way_to_choose_offsets(self) -> SourceConfig:
        if self.at is not None and self.ranges is not None:
            raise ValueError("source.at and source.ranges both choose the snapshot's offsets: set one")
        if self.topic is not None and self.mapping is None:
            raise ValueError(f"source.topic {self.topic!r} needs source.mapping (features and label)")
        return self

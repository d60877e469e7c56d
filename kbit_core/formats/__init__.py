"""Serialization formats for samples (images, token sequences) in Kafka: a Codec per format, looked up by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kbit_core.config import DataVariant
from kbit_core.errors import ConfigError
from kbit_core.formats.avro_codec import AvroCodec
from kbit_core.formats.base import LAYOUTS, Codec, DecodedBatch
from kbit_core.formats.bson_codec import BsonCodec
from kbit_core.formats.confluent.framed import ConfluentFramedCodec, framed
from kbit_core.formats.fast import DECODERS, select_codec  # noqa: E402 - the fast codecs subclass the ones above
from kbit_core.formats.json_codec import JsonCodec
from kbit_core.formats.mongodb_avro_codec import MongoDBAvroCodec
from kbit_core.formats.protobuf_codec import ProtobufCodec
from kbit_core.formats.raw_codec import RawCodec

__all__ = [
    "LAYOUTS",
    "Codec",
    "ConfluentFramedCodec",
    "DecodedBatch",
    "RecordShape",
    "codec_names",
    "get_codec",
    "supported",
    "variant_codec",
]

_CODECS: dict[str, type[Codec]] = {
    c.format: c for c in (JsonCodec, AvroCodec, ProtobufCodec, BsonCodec, MongoDBAvroCodec, RawCodec)
}


def codec_names() -> tuple[str, ...]:
    """The format names get_codec accepts."""
    return tuple(_CODECS)


def supported(format: str, layout: str) -> bool:
    """Whether ``format`` exists and has the pixel ``layout``."""
    return format in _CODECS and layout in _CODECS[format].layouts


def get_codec(
    format: str,
    layout: str,
    image_shape: Sequence[int],
    records_per_message: int = 1,
    *,
    num_classes: int | None = None,
    decoder: str = "stock",
    dtype: str = "uint8",
    framing: str = "kbit",
) -> Codec:
    """The codec for ``format`` in ``layout`` for records of ``image_shape``: images (C, H, W) or token ids (L,).

    Args:
        format: One of ``codec_names()``.
        layout: ``"list"`` (floats in [0, 1]) or ``"bytes"`` (uint8).
        image_shape: (C, H, W) of every sample.
        records_per_message: Samples per Kafka message. Defaults to ``1``.
        num_classes: When given, decoding refuses labels outside ``[0, num_classes)``.
        decoder: ``"stock"`` decodes with the format's library; ``"fast"`` with kbit's schema-aware decoder
            where one recognises the schema (same results bit for bit; see ``kbit_core.formats.fast``).
        dtype: The records' element type: ``"uint8"`` (images) or ``"uint16"`` (token ids; bytes layout of raw
            and protobuf only).
        framing: ``"kbit"`` (the format's own bytes) or ``"confluent"`` (the Confluent wire format: see
            ``kbit_core.formats.confluent.framed``).

    Raises:
        ConfigError: unknown format or layout, or a combination the format cannot carry.
    """
    try:
        codec_class = _CODECS[format]
    except KeyError:
        raise ConfigError(f"unknown format {format!r}; known: {', '.join(_CODECS)}") from None
    codec = codec_class(layout, image_shape, records_per_message, num_classes=num_classes, dtype=dtype)
    if decoder not in DECODERS:
        raise ConfigError(f"unknown decoder {decoder!r}; expected one of {', '.join(DECODERS)}")
    return framed(select_codec(codec, decoder), framing)  # type: ignore[return-value]


class RecordShape(Protocol):
    """What a codec needs to know of a dataset's records: a ``DatasetSource``, or the dataset a manifest names."""

    @property
    def image_shape(self) -> Sequence[int]: ...

    @property
    def num_classes(self) -> int: ...

    @property
    def record_dtype(self) -> str: ...


def variant_codec(variant: DataVariant, records: RecordShape, decoder: str = "stock") -> Codec:
    """The codec that carries ``records`` in ``variant`` (format, layout, records per message), decoding with
    ``decoder`` (``reader.decoder`` wherever records are decoded; encoding is the same with either): every codec
    kbit builds from its config comes from here.

    Raises:
        ConfigError: the variant cannot carry these records, or an unknown decoder.
    """
    return get_codec(
        variant.format,
        variant.layout,
        records.image_shape,
        variant.records_per_message,
        num_classes=records.num_classes,
        decoder=decoder,
        dtype=records.record_dtype,
        framing=variant.framing,
    )

"""The decoders of message values kbit did not write, by value format (``source.value_format``).

Each entry is a constructor called as ``constructor(decoder=<reader.decoder: "fast" or "stock">,
**source.value_options)`` that returns a :class:`~kbit_core.formats.records.RecordDecoder`; its value must pickle
(decode worker processes receive it). Values in the Confluent wire format (``confluent-avro``, ``confluent-json``,
``confluent-protobuf``) are decoded by the writer schema each names, fetched from the registry ``registry.*`` points at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kbit_core.config import RegistryConfig
from kbit_core.errors import ConfigError
from kbit_core.formats.confluent.decoders import confluent_decoder
from kbit_core.formats.confluent.files import avro_file_decoder, protobuf_descriptor_decoder
from kbit_core.formats.json_records import JsonRecordDecoder
from kbit_core.formats.records import RecordDecoder

RECORD_DECODERS: dict[str, Callable[..., RecordDecoder]] = {
    "json": JsonRecordDecoder,
    "avro": avro_file_decoder,  # value_options: schema_path (.avsc), reader_schema_path
    # value_options: descriptor_set (a FileDescriptorSet file), message (its full name); upb decodes, no fast path
    "protobuf": lambda decoder, **options: protobuf_descriptor_decoder(**options),
}
# The Confluent wire format's value formats; value_options: reader ("latest", an id or "writer"), subject.
CONFLUENT_FORMATS = {"confluent-avro": "avro", "confluent-json": "json", "confluent-protobuf": "protobuf"}


def make_record_decoder(
    value_format: str,
    options: Mapping[str, Any],
    decoder: str = "fast",
    *,
    topic: str,
    registry: RegistryConfig | None = None,
) -> RecordDecoder:
    """The decoder of ``topic``'s values in ``value_format``, built with ``options`` (and for the Confluent framing
    the ``registry`` settings); ConfigError naming the known formats otherwise."""
    if value_format in CONFLUENT_FORMATS:
        return confluent_decoder(
            registry or RegistryConfig(), topic, CONFLUENT_FORMATS[value_format], decoder=decoder, **options
        )
    try:
        constructor = RECORD_DECODERS[value_format]
    except KeyError:
        known = sorted([*RECORD_DECODERS, *CONFLUENT_FORMATS])
        raise ConfigError(f"source.value_format {value_format!r} is unknown; known: {', '.join(known)}") from None
    return constructor(decoder=decoder, **options)

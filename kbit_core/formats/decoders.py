"""The decoders of message values kbit did not write, by value format (``source.value_format``).

Each entry is a constructor called as ``constructor(decoder=<reader.decoder: "fast" or "stock">,
**source.value_options)`` that returns a :class:`~kbit_core.formats.records.RecordDecoder`; its value must pickle
(decode worker processes receive it). Schema Registry framings and schema files add one entry each here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kbit_core.errors import ConfigError
from kbit_core.formats.json_records import JsonRecordDecoder
from kbit_core.formats.records import RecordDecoder

RECORD_DECODERS: dict[str, Callable[..., RecordDecoder]] = {
    "json": JsonRecordDecoder,
}


def make_record_decoder(value_format: str, options: Mapping[str, Any], decoder: str = "fast") -> RecordDecoder:
    """The decoder of ``value_format`` built with ``options``; ConfigError naming the known formats otherwise."""
    try:
        constructor = RECORD_DECODERS[value_format]
    except KeyError:
        raise ConfigError(
            f"source.value_format {value_format!r} is unknown; known: {', '.join(sorted(RECORD_DECODERS))}"
        ) from None
    return constructor(decoder=decoder, **options)

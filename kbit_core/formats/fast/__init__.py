"""Schema-aware fast decoders, one per format × layout where the stock library is the bottleneck.

``select_codec(codec, "fast")`` returns the fast subclass of ``codec`` when one exists and recognises the
codec's schema, else ``codec`` itself with the reason logged. A fast codec encodes, fingerprints and fails like
its stock codec and decodes to the same arrays bit for bit (see ``base.FastPath``).
"""

from __future__ import annotations

import logging

from kbit_core.formats.base import Codec
from kbit_core.formats.fast.avro import FastAvroCodec
from kbit_core.formats.fast.base import FastPath, UnsupportedSchema
from kbit_core.formats.fast.bson import FastBsonCodec
from kbit_core.formats.fast.json import FastJsonCodec
from kbit_core.formats.fast.mongodb_avro import FastMongoDBAvroCodec
from kbit_core.formats.fast.protobuf import FastProtobufCodec

__all__ = ["DECODERS", "FastPath", "select_codec", "stock_reason"]

log = logging.getLogger(__name__)

DECODERS = ("fast", "stock")

_FAST: dict[tuple[str, str], type[Codec]] = {
    ("avro", "list"): FastAvroCodec,
    ("avro", "bytes"): FastAvroCodec,
    ("mongodb_avro", "list"): FastMongoDBAvroCodec,
    ("mongodb_avro", "bytes"): FastMongoDBAvroCodec,
    ("json", "list"): FastJsonCodec,
    ("json", "bytes"): FastJsonCodec,
    ("protobuf", "list"): FastProtobufCodec,
    ("protobuf", "bytes"): FastProtobufCodec,
    ("bson", "list"): FastBsonCodec,
    ("bson", "bytes"): FastBsonCodec,
}

# Why a format × layout has no fast decoder: its stock path already builds the batch in C.
_STOCK_IS_FAST = {
    ("raw", "bytes"): "raw decodes with one np.frombuffer per batch",
}


def stock_reason(format: str, layout: str) -> str | None:
    """Why ``format``/``layout`` always decodes with the stock library, or None when it has a fast decoder."""
    if (format, layout) in _FAST:
        return None
    return _STOCK_IS_FAST.get((format, layout), "no fast decoder is written for it")


def select_codec(codec: Codec, decoder: str = "fast") -> Codec:
    """The codec that decodes ``codec``'s topic with ``decoder`` (``fast`` | ``stock``); see the module docstring.
    A codec wrapped in another framing (``formats.confluent.framed``) gets its inner codec selected."""
    if hasattr(codec, "inner"):
        return codec.with_inner(select_codec(codec.inner, decoder))
    if decoder == "stock" or isinstance(codec, FastPath):
        return codec
    fast_class = _FAST.get((codec.format, codec.layout))
    if fast_class is None:
        log.info("%s decodes with the stock library: %s", codec.name, stock_reason(codec.format, codec.layout))
        return codec
    try:
        fast = fast_class(
            codec.layout,
            codec.image_shape,
            codec.records_per_message,
            num_classes=codec.num_classes,
            dtype=codec.dtype.name,
        )
    except UnsupportedSchema as exc:
        log.warning(
            "%s decodes with the stock library: the fast decoder does not recognise its schema (%s)", codec.name, exc
        )
        return codec
    if fast.schema_fingerprint() != codec.schema_fingerprint():
        log.warning(
            "%s decodes with the stock library: the fast decoder's schema fingerprint %s differs from %s",
            codec.name,
            fast.schema_fingerprint()[:16],
            codec.schema_fingerprint()[:16],
        )
        return codec
    return fast

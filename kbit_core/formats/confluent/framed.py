"""kbit's own variants in the Confluent framing (``produce.variant.framing: confluent``): written by confluent-kafka's
serializers (AvroSerializer, ProtobufSerializer, JSONSerializer), which register kbit's schema under
``<topic>-value``; read back by stripping the header (and Protobuf's message indexes) and decoding the payload with
kbit's codec, into the same DecodedBatch as kbit's framing."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from confluent_kafka.schema_registry import topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kbit_core.config.registry import RegistryConfig
from kbit_core.errors import ConfigError
from kbit_core.formats.base import Codec, DecodedBatch
from kbit_core.formats.confluent.framing import HEADER_BYTES, FramingError, message_indexes, schema_id
from kbit_core.formats.confluent.source import SchemaSource, configured_or_stack_registry
from kbit_core.formats.schemas import kbit_pb2

FRAMINGS = ("kbit", "confluent")
FRAMED_FORMATS = ("avro", "json", "protobuf")


class ConfluentFramedCodec:
    """``inner``'s values in the Confluent framing; every other attribute is ``inner``'s. Encoding needs
    :meth:`bind` (the registry and the topic, whose subject the serializer registers kbit's schema under)."""

    def __init__(self, inner: Codec) -> None:
        if inner.format not in FRAMED_FORMATS:
            raise ConfigError(
                f"format {inner.format!r} has no Confluent framing (framing: confluent takes {', '.join(FRAMED_FORMATS)})"
            )
        self.inner = inner
        self._serializer: Any = None
        self._context: SerializationContext | None = None

    def with_inner(self, inner: Codec) -> ConfluentFramedCodec:
        """The same framing around ``inner`` (the fast or stock codec of the same schema), bound as this one is."""
        other = ConfluentFramedCodec(inner)
        other._serializer, other._context = self._serializer, self._context
        return other

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ConfluentFramedCodec, (self.inner,)

    def __repr__(self) -> str:
        return f"ConfluentFramedCodec({self.inner!r})"

    @property
    def name(self) -> str:
        return f"{self.inner.name}+confluent"

    def schema_fingerprint(self) -> str:
        return hashlib.sha256(f"{self.inner.schema_fingerprint()}:confluent-framing".encode()).hexdigest()

    def bind(self, registry: RegistryConfig, topic: str) -> ConfluentFramedCodec:
        """Make the serializer for ``topic`` (its client on ``registry``, or with none named a running local stack's;
        retried as every registry call is)."""
        registry = configured_or_stack_registry(registry)
        if not registry.enabled:
            raise ConfigError(
                "produce.variant.framing: confluent registers kbit's schema in a Schema Registry: set registry.url "
                "or registry.local.enabled (and start it: kbit stack up)"
            )
        source = SchemaSource(registry)
        self._context = SerializationContext(topic, MessageField.VALUE)
        codec = self.inner
        conf = {"subject.name.strategy": topic_subject_name_strategy}  # <topic>-value, named without a registry call
        if codec.format == "avro":
            self._serializer = AvroSerializer(source.client, codec.schema_text(), conf=conf)
        elif codec.format == "json":
            self._serializer = JSONSerializer(json.dumps(codec.json_schema()), source.client, conf=conf)
        else:
            message = kbit_pb2.Sample if codec.records_per_message == 1 else kbit_pb2.SampleBatch
            self._serializer = ProtobufSerializer(message, source.client, {**conf, "use.deprecated.format": False})
        # registered now, retried within registry.deadline_s as every registry call is, not by the first send
        sample = self.inner.encode_objects(*_one_sample(codec))[0]
        source.call(f"registering kbit's schema for topic {topic}", self._serializer, sample, self._context)
        return self

    def encode(self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray) -> list[bytes]:
        if self._serializer is None:
            raise ConfigError(f"{self.name}: encoding needs the Schema Registry (bind it first)")
        return [self._serializer(obj, self._context) for obj in self.inner.encode_objects(indices, images, labels)]

    def payload(self, value: bytes) -> bytes:
        """``value`` without its Confluent header (and, for Protobuf, its message indexes)."""
        schema_id(value)
        if self.inner.format != "protobuf":
            return value[HEADER_BYTES:]
        _, start = message_indexes(value)
        return value[start:]

    def decode(self, values: Sequence[bytes]) -> DecodedBatch:
        protobuf = self.inner.format == "protobuf"
        start, index = (HEADER_BYTES + 1, HEADER_BYTES) if protobuf else (HEADER_BYTES, 0)
        try:  # the common case in one pass: the magic byte (and Protobuf's single message index [0], byte 0x00)
            payloads = [v[start:] for v in values if v[0] == 0 and v[index] == 0 and len(v) >= start]
        except (TypeError, IndexError):  # a null or empty value
            payloads = []
        if len(payloads) == len(values):
            return self.inner.decode(payloads)
        try:
            payloads = [self.payload(value) for value in values]
        except FramingError:
            position, exc = next(self._unframed(values))
            raise self.inner.corrupt_value_error(position, len(values), values[position], exc) from None
        return self.inner.decode(payloads)

    def failing_values(self, values: Sequence[bytes]) -> Iterator[tuple[int, Exception]]:
        for position, value in enumerate(values):
            try:
                self.inner._decode([self.payload(value)])
            except Exception as exc:  # noqa: BLE001 - as the inner codec's own failing_values
                yield position, exc

    def _unframed(self, values: Sequence[bytes]) -> Iterator[tuple[int, Exception]]:
        for position, value in enumerate(values):
            try:
                self.payload(value)
            except FramingError as exc:
                yield position, exc


def _one_sample(codec: Codec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(1, np.int64), np.zeros((1, *codec.image_shape), codec.dtype), np.zeros(1, np.int64)


def framed(codec: Codec, framing: str) -> Codec | ConfluentFramedCodec:
    """``codec`` in ``framing`` (kbit: as it is; confluent: :class:`ConfluentFramedCodec`)."""
    if framing not in FRAMINGS:
        raise ConfigError(f"unknown framing {framing!r}; expected one of {', '.join(FRAMINGS)}")
    return codec if framing == "kbit" else ConfluentFramedCodec(codec)

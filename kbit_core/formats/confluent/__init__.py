"""Values kbit did not frame: the Confluent wire format with writer schemas from a Schema Registry, schemaless Avro
with a schema file, Protobuf with a descriptor set, each a ``records.RecordDecoder``; and the Confluent framing of
kbit's own variants (``framed``)."""

from kbit_core.formats.confluent.decoders import ConfluentDecoder, confluent_decoder
from kbit_core.formats.confluent.files import (
    AvroFileDecoder,
    ProtobufFileDecoder,
    avro_file_decoder,
    protobuf_descriptor_decoder,
)
from kbit_core.formats.confluent.source import SchemaSource, UnknownSchemaError

__all__ = [
    "AvroFileDecoder",
    "ConfluentDecoder",
    "ProtobufFileDecoder",
    "SchemaSource",
    "UnknownSchemaError",
    "avro_file_decoder",
    "confluent_decoder",
    "protobuf_descriptor_decoder",
]

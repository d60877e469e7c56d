"""The original's MongoDB export: JSON documents wrapping schemaless Avro in a BSON Binary.

``{"binary_data": {"Subtype": 0, "Data": "<base64 Avro MNISTImage>"}, "_source": "mongodb",
"_collection": ..., "_database": ..., "schema_fingerprint": ...}``, one sample per message, as the
export service wrote them. Unlike the original consumer, decoding checks ``schema_fingerprint``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import orjson

from kbit_core.formats.avro_codec import AvroCodec
from kbit_core.formats.base import canonical_json, required

DATABASE = "kbit"
COLLECTION = "images"
BINARY_SUBTYPE = 0  # BSON generic binary


class MongoDBAvroCodec(AvroCodec):
    format = "mongodb_avro"
    max_records_per_message = 1
    single_record_reason = "the MongoDB export wraps exactly one stored document per Kafka message"
    schema_files = {"list": ("ImageMetadata", "MongoMNISTImage"), "bytes": ("ImageMetadata", "MongoMNISTImageBytes")}

    def _meta(self, index: int) -> dict[str, Any]:
        # ImageMetadata's dataset/split are not known to a codec; the sample index is.
        return {"dataset": "", "split": "", "index": index}

    def _encode_group(self, indices: np.ndarray, labels: np.ndarray, pixels: np.ndarray) -> bytes:
        avro = super()._encode_group(indices, labels, pixels)
        return orjson.dumps(
            {
                "binary_data": {"Subtype": BINARY_SUBTYPE, "Data": base64.b64encode(avro).decode("ascii")},
                "_source": "mongodb",
                "_collection": COLLECTION,
                "_database": DATABASE,
                "schema_fingerprint": self.schema_fingerprint(),
            }
        )

    def _parse_one(self, value: bytes) -> dict[str, Any]:
        return super()._parse_one(self._avro_payload(value))

    def _avro_payload(self, value: bytes) -> bytes:
        """The schemaless Avro bytes inside an export envelope, after checking the envelope."""
        doc = orjson.loads(value)
        fingerprint = required(doc, "schema_fingerprint")
        if fingerprint != self.schema_fingerprint():
            raise ValueError(
                f"schema_fingerprint {str(fingerprint)[:16]}... is not this codec's "
                f"{self.schema_fingerprint()[:16]}... (written with another schema)"
            )
        binary = required(doc, "binary_data")
        if required(binary, "Subtype") != BINARY_SUBTYPE:
            raise ValueError(f"binary_data.Subtype is {binary['Subtype']!r}, expected {BINARY_SUBTYPE}")
        data = required(binary, "Data")
        if not isinstance(data, str):
            raise ValueError(f"binary_data.Data must be a base64 string, got {type(data).__name__}")
        return binascii.a2b_base64(data, strict_mode=True)

    def _definition(self) -> str:
        envelope = {
            "binary_data": {"Subtype": BINARY_SUBTYPE, "Data": "base64(avro)"},
            "_source": "mongodb",
            "_collection": "string",
            "_database": "string",
            "schema_fingerprint": "string",
        }
        return f"{canonical_json(envelope)}\n{super()._definition()}"

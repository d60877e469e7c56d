"""The value types every section shares and the base of every config section (unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Format = Literal["json", "avro", "protobuf", "bson", "mongodb_avro", "raw"]


Layout = Literal["list", "bytes"]


Compression = Literal["none", "gzip", "lz4", "snappy", "zstd"]


ClientName = Literal["confluent", "kafka-python"]


FORMATS: tuple[str, ...] = ("json", "avro", "protobuf", "bson", "mongodb_avro", "raw")


COMPRESSIONS: tuple[str, ...] = ("none", "gzip", "lz4", "snappy", "zstd")


class Section(BaseModel):
    """Base for every section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

"""The exact offset manifest of one produce run: which offsets of which partitions hold the dataset, in what form."""

from __future__ import annotations

import hashlib
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kbit_core.config import DataVariant, MappingConfig, RegistryConfig
from kbit_core.errors import ManifestMismatchError, TopicError
from kbit_core.formats import Codec, variant_codec
from kbit_core.formats.decoders import make_record_decoder
from kbit_core.formats.mapping import MappedCodec
from kbit_core.sharding import OffsetRange

MANIFEST_DIR = "manifests"
# Kafka's own rule for topic names; it also keeps a topic from escaping the manifest directory.
TOPIC_PATTERN = r"^[A-Za-z0-9._-]{1,249}$"
DIGEST_BYTES = 16
DIGEST_MODULUS = 1 << (8 * DIGEST_BYTES)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetInfo(_Frozen):
    name: str
    seed: int
    num_records: int = Field(ge=0)
    image_shape: tuple[int, ...] = Field(description="One record's shape: (C, H, W) images, (L,) token sequences.")
    num_classes: int = Field(ge=1)
    record_dtype: Literal["uint8", "uint16", "float32"] = Field(
        "uint8", description="uint8 pixels, uint16 token ids, or float32 features (a user's topic, mapped)."
    )
    vocab_size: int | None = Field(None, ge=1, description="Token sequences: every id lies in [0, vocab_size).")


class PartitionManifest(_Frozen):
    """One partition's share. Offsets are inclusive (the original's convention); an empty share has last = first - 1."""

    partition: int = Field(ge=0)
    first_offset: int = Field(ge=0)
    last_offset: int = Field(ge=-1)
    num_messages: int = Field(ge=0)
    num_records: int = Field(ge=0)
    value_bytes: int = Field(ge=0)
    content_digest: str | None = Field(
        None,
        description="Digest of every message's key and value at its offset (see record_digest); None in manifests "
        "written before kbit kept one.",
    )

    @model_validator(mode="after")
    def _offsets_cover_messages(self) -> PartitionManifest:
        if self.last_offset - self.first_offset + 1 != self.num_messages:
            raise ValueError(
                f"partition {self.partition}: offsets {self.first_offset}..{self.last_offset} do not hold "
                f"exactly {self.num_messages} messages"
            )
        return self

    @property
    def stop_offset(self) -> int:
        """Exclusive end, the form kbit uses internally."""
        return self.last_offset + 1


def message_digest(key: bytes | None, value: bytes | None) -> bytes:
    """A message's own digest: its key and value (a 16-byte BLAKE2b)."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    key, value = key or b"", value or b""
    digest.update(len(key).to_bytes(4, "big"))
    digest.update(key)
    digest.update(value)
    return digest.digest()


def record_digest(offset: int, message: bytes) -> int:
    """One message's share of its partition's content digest: bound to its offset, so a partition's digest is the
    sum of its shares (mod 2^128), in whatever order they are added, and changes when a message moves."""
    share = hashlib.blake2b(offset.to_bytes(8, "big") + message, digest_size=DIGEST_BYTES).digest()
    return int.from_bytes(share, "big")


def digest_hex(total: int) -> str:
    return f"{total % DIGEST_MODULUS:0{2 * DIGEST_BYTES}x}"


class DataIdentity(_Frozen):
    """What a topic's contents are, independent of when or how fast they were produced."""

    dataset: DatasetInfo
    variant: DataVariant
    partitions: int = Field(ge=1)
    schema_fingerprint: str

    def differences(self, other: DataIdentity) -> list[str]:
        """Human-readable 'field: ours != theirs' lines; empty when both describe the same data."""
        diffs: list[str] = []
        for section in ("dataset", "variant"):
            ours, theirs = getattr(self, section).model_dump(), getattr(other, section).model_dump()
            diffs += [
                f"{section}.{key}: {ours[key]!r} != {theirs.get(key)!r}" for key in ours if ours[key] != theirs.get(key)
            ]
        if self.partitions != other.partitions:
            diffs.append(f"partitions: {self.partitions} != {other.partitions}")
        if self.schema_fingerprint != other.schema_fingerprint:
            diffs.append(f"schema_fingerprint: {self.schema_fingerprint} != {other.schema_fingerprint}")
        return diffs


class TopicSnapshot(_Frozen):
    """What makes a manifest the snapshot of a topic kbit did not write: the topic is never recreated, deleted or
    written, only read at the recorded offsets, its values decoded by ``value_format`` and mapped by ``mapping``."""

    topic_id: str | None = Field(description="The broker's id of the topic; a recreated topic has a new one.")
    taken_at: datetime
    at: datetime | None = Field(None, description="The snapshot holds the records before this time (source.at).")
    ranges: list[str] | None = Field(None, description="The explicit ranges asked for (source.ranges).")
    value_format: str
    value_options: dict[str, Any] = Field(default_factory=dict)
    mapping: MappingConfig
    vocabulary: list[str] | None = Field(None, description="String labels, in class order (given or discovered).")
    split_times: list[datetime] = Field(
        default_factory=list, description="shard.split_times the split_offsets were found for."
    )
    split_offsets: dict[int, list[int]] | None = Field(
        None, description="partition -> its first offset at each of split_times (a split by time)."
    )
    key_hash_rates: list[float] | None = Field(
        None, description="shard.split_rates the key_runs were drawn for (a split by key hash)."
    )
    key_hash_seed: int | None = Field(None, description="shard.seed the key_runs were drawn with.")
    key_runs: dict[int, list[tuple[int, int, int]]] | None = Field(
        None,
        description="partition -> (split, first offset, stop) runs of consecutive records whose keys hash to one "
        "split (a split by key hash, key_splits.split_runs).",
    )

    def partition_starts(self, partitions: list[PartitionManifest]) -> dict[int, tuple[int, int]]:
        """partition -> (first offset, snapshot index of its first record): indices run partition by partition."""
        starts, base = {}, 0
        for part in partitions:
            starts[part.partition] = (part.first_offset, base)
            base += part.num_messages
        return starts


class Manifest(_Frozen):
    topic: str = Field(pattern=TOPIC_PATTERN)
    dataset: DatasetInfo
    variant: DataVariant
    schema_fingerprint: str
    partitions: list[PartitionManifest]
    num_messages: int = Field(ge=0)
    num_records: int = Field(ge=0)
    value_bytes: int = Field(ge=0)
    wire_bytes: int | None = Field(None, ge=0, description="Compressed record-batch bytes sent; None if unknown.")
    dropped_records: int = Field(0, ge=0)
    produce_seconds: float = Field(ge=0)
    client: str
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    kbit_version: str
    source: TopicSnapshot | None = Field(
        None, description="Set when the topic is not kbit's: a snapshot of it (never recreated, deleted or written)."
    )

    @property
    def kbit_wrote_it(self) -> bool:
        return self.source is None

    @model_validator(mode="after")
    def _totals_add_up(self) -> Manifest:
        ids = [p.partition for p in self.partitions]
        if ids != list(range(len(ids))) or not ids:
            raise ValueError(f"partitions must be 0..n-1 in order, got {ids}")
        for total in ("num_messages", "num_records", "value_bytes"):
            parts = sum(getattr(p, total) for p in self.partitions)
            if parts != getattr(self, total):
                raise ValueError(f"{total}={getattr(self, total)} but the partitions add up to {parts}")
        return self

    @property
    def identity(self) -> DataIdentity:
        return DataIdentity(
            dataset=self.dataset,
            variant=self.variant,
            partitions=len(self.partitions),
            schema_fingerprint=self.schema_fingerprint,
        )

    def matches(self, other: Manifest | DataIdentity) -> list[str]:
        """Differences in what the data is (dataset, variant, partition count, schema); empty means the same."""
        return self.identity.differences(other.identity if isinstance(other, Manifest) else other)

    def ranges(self) -> dict[int, tuple[int, int]]:
        """partition -> half-open (start, stop)."""
        return {p.partition: (p.first_offset, p.stop_offset) for p in self.partitions}

    def offset_strings(self) -> list[str]:
        """The original's inclusive 'partition:start:last' strings (``sharding.parse_offset_strings`` reads them)."""
        return [OffsetRange(p, start, stop).inclusive_string() for p, (start, stop) in self.ranges().items()]

    def save(self, directory: Path) -> Path:
        """Write ``<directory>/<topic>.json`` atomically (a crash never leaves half a manifest) and return its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.topic}.json"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.topic}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(self.model_dump_json(indent=2))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: Path) -> Manifest:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise TopicError(f"no manifest at {path}; produce the topic first (kbit produce)") from None
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise TopicError(f"manifest {path} is invalid: {exc}") from None


def manifest_path(workdir: Path, topic: str) -> Path:
    """Where the manifest of ``topic`` lives: ``<workdir>/manifests/<topic>.json``."""
    return Path(workdir).resolve() / MANIFEST_DIR / f"{topic}.json"


def manifest_codec(manifest: Manifest, decoder: str = "stock", registry: RegistryConfig | None = None) -> Codec:
    """The codec the topic was written with, decoding with ``decoder`` (``fast`` falls back to the stock library,
    logging why, when no fast decoder recognises the schema); ManifestMismatchError when this kbit's schema
    differs. A snapshot of a user's topic decodes with its value format's decoder (writer schemas from ``registry``
    for the Confluent framing) and its mapping."""
    if manifest.source is not None:
        return _mapped_codec(manifest, manifest.source, decoder, registry)
    variant = manifest.variant
    codec = variant_codec(variant, manifest.dataset, decoder)
    if codec.schema_fingerprint() != manifest.schema_fingerprint:
        raise ManifestMismatchError(
            f"topic {manifest.topic!r} was written with schema {manifest.schema_fingerprint}, but this kbit's "
            f"{variant.format}/{variant.layout} codec has schema {codec.schema_fingerprint()}; produce it again "
            f"(kbit produce --recreate)"
        )
    return codec


def _mapped_codec(
    manifest: Manifest, source: TopicSnapshot, decoder: str, registry: RegistryConfig | None
) -> MappedCodec:
    return MappedCodec(
        make_record_decoder(
            source.value_format, source.value_options, decoder, topic=manifest.topic, registry=registry
        ),
        source.mapping,
        source.partition_starts(manifest.partitions),
        vocabulary=source.vocabulary,
        num_classes=manifest.dataset.num_classes,
    )

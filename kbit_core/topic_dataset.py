"""A topic kbit did not write, as a dataset: its snapshot manifest (taken, or reused while the topic still holds it),
its label vocabulary discovered when needed, and its mapping checked before any rank starts.

The snapshot is saved as the topic's manifest in the workdir and recorded in the broker's manifest registry, so
another run or workdir reuses it; it is marked as not kbit's (``Manifest.source``), so no kbit command deletes,
recreates or writes the topic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from kbit_core.config import DataVariant, KbitConfig, MappingConfig
from kbit_core.config.topics import KEY_FIELD, TIMESTAMP_FIELD, is_message_field
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ConfigError, CorruptRecordError, KbitError, ManifestMismatchError
from kbit_core.formats.decoders import make_record_decoder
from kbit_core.formats.message_fields import message_columns, message_field_kind
from kbit_core.formats.records import RecordDecoder, WriterSchema
from kbit_core.kafka import manifest_registry
from kbit_core.kafka.consumers import RawRecord
from kbit_core.kafka.manifest import DatasetInfo, Manifest, PartitionManifest, TopicSnapshot, manifest_codec
from kbit_core.kafka.manifest import manifest_path as manifest_file
from kbit_core.kafka.snapshot import moved_on, offsets_at, snapshot_ranges, topic_offsets
from kbit_core.key_splits import key_hash_splits, split_runs
from kbit_core.produce import kbit_version, record_manifest
from kbit_core.sharding import OffsetRange

log = logging.getLogger(__name__)

# Records decoded at preflight to check a mapping against values without a schema (plain JSON).
SAMPLE_RECORDS = 64
# Kinds of a writer schema's field each use of it takes (see formats.records.FIELD_KINDS).
_FEATURE_KINDS = {"array": ("array<int>", "array<float>"), "bytes": ("bytes",), "base64": ("string",)}
_SCALAR_KINDS = ("int", "float", "bool")
_LABEL_KINDS = ("int", "string")
# Offsets whose keys are read in one go for a split by key hash (their records are held only while hashed).
KEY_READ_BLOCK = 65_536


def snapshot_dataset(cfg: KbitConfig) -> Manifest:
    """The manifest of ``source.topic``: the saved snapshot when it asked for the same and the topic still holds
    it, else a new one (saved and recorded); its mapping checked against the writer schema or the first records.

    Raises:
        ManifestMismatchError: the saved snapshot's topic moved on (records deleted, recreated, compacted).
        ConfigError: the mapping does not fit the records.
    """
    topic = cfg.source.topic
    assert topic is not None
    saved = _saved_snapshot(cfg, topic) if cfg.source.snapshot == "reuse" else None
    if saved is not None and saved.source == _requested(cfg, saved.source):
        problems = moved_on(cfg.kafka, saved)
        if problems:
            raise ManifestMismatchError(
                f"topic {topic!r} moved on since its snapshot of {saved.created_at:%Y-%m-%d %H:%M:%S} "
                f"({manifest_file(cfg.workdir, topic)}): {'; '.join(problems)}; take a new one with "
                "source.snapshot=new"
            )
        log.info("reusing the snapshot of topic %s (%d records)", topic, saved.num_records)
        return saved
    manifest = take_snapshot(cfg)
    check_mapping(cfg, manifest)
    manifest.save(cfg.manifest_dir)
    record_manifest(cfg, topic, manifest)
    return manifest


def take_snapshot(cfg: KbitConfig) -> Manifest:
    """A new snapshot of ``source.topic``: every partition's offsets now, before ``source.at``, or
    ``source.ranges``, with the split-by-time offsets and the discovered label vocabulary."""
    src, topic = cfg.source, cfg.source.topic
    assert topic is not None and src.mapping is not None
    check_message_fields(src.mapping)
    offsets = topic_offsets(cfg.kafka, topic)
    ranges = snapshot_ranges(cfg.kafka, offsets, src.at, src.ranges)
    parts = [
        PartitionManifest(
            partition=p,
            first_offset=start,
            last_offset=stop - 1,
            num_messages=stop - start,
            num_records=stop - start,
            value_bytes=0,
        )
        for p, (start, stop) in sorted(ranges.items())
    ]
    snapshot = TopicSnapshot(
        topic_id=offsets.topic_id,
        taken_at=datetime.now(UTC),
        **_asked(cfg),
        split_offsets=_split_offsets(cfg, ranges),
        key_runs=_key_runs(cfg, ranges) if cfg.shard.split_by == "key_hash" else None,
    )
    decoder = make_record_decoder(src.value_format, src.value_options, "stock", topic=topic, registry=cfg.registry)
    vocabulary, num_classes = _classes(cfg, src.mapping, decoder, ranges)
    snapshot = snapshot.model_copy(update={"vocabulary": vocabulary})
    mapping = src.mapping
    total = sum(p.num_messages for p in parts)
    info = DatasetInfo(
        name=f"topic {topic}",
        seed=0,
        num_records=total,
        image_shape=mapping.record_shape,
        num_classes=num_classes,
        record_dtype=mapping.dtype,
    )
    draft = Manifest(
        topic=topic,
        dataset=info,
        variant=snapshot_variant(cfg),
        schema_fingerprint="",
        partitions=parts,
        num_messages=total,
        num_records=total,
        value_bytes=0,
        produce_seconds=0.0,
        client="none (a snapshot)",
        kbit_version=kbit_version(),
        source=snapshot,
    )
    return draft.model_copy(
        update={"schema_fingerprint": manifest_codec(draft, "stock", cfg.registry).schema_fingerprint()}
    )


def snapshot_variant(cfg: KbitConfig) -> DataVariant:
    """The variant a snapshot's manifest names: JSON-like records of float features (list) or of integers (bytes);
    its compression is the user's producers', unknown to kbit ("none")."""
    assert cfg.source.mapping is not None
    layout = "list" if cfg.source.mapping.dtype == "float32" else "bytes"
    return DataVariant(format="json", layout=layout, compression="none")


def _asked(cfg: KbitConfig) -> dict[str, object]:
    """The snapshot's settings from the config: what a saved snapshot must match to be reused."""
    src, key_hash = cfg.source, cfg.shard.split_by == "key_hash"
    return {
        "at": src.at,
        "ranges": src.ranges,
        "value_format": src.value_format,
        "value_options": src.value_options,
        "mapping": src.mapping,
        "split_times": cfg.shard.split_times,
        "key_hash_rates": cfg.shard.split_rates if key_hash else None,
        "key_hash_seed": cfg.shard.seed if key_hash else None,
    }


def _requested(cfg: KbitConfig, saved: TopicSnapshot | None) -> TopicSnapshot | None:
    """``saved`` with the config's settings in place of its own (equal to ``saved`` when they agree); the
    vocabulary is compared only when the mapping gives one."""
    if saved is None:
        return None
    vocabulary = cfg.source.mapping.vocabulary if cfg.source.mapping is not None else None
    return saved.model_copy(update={**_asked(cfg), "vocabulary": vocabulary or saved.vocabulary})


def _saved_snapshot(cfg: KbitConfig, topic: str) -> Manifest | None:
    """This workdir's snapshot of ``topic``, else one another workdir recorded in the broker's registry."""
    path = manifest_file(cfg.workdir, topic)
    if path.is_file():
        saved = Manifest.load(path)
        return saved if saved.source is not None else None
    try:
        registered = manifest_registry.lookup(cfg.kafka, topic)
    except KbitError:
        return None
    if registered is None or registered.manifest is None or registered.manifest.source is None:
        return None
    log.info(
        "adopting the snapshot of topic %s recorded in %s by %s",
        topic,
        manifest_registry.REGISTRY_TOPIC,
        registered.owner,
    )
    return registered.manifest


def _split_offsets(cfg: KbitConfig, ranges: dict[int, tuple[int, int]]) -> dict[int, list[int]] | None:
    """partition -> its first offset at each of ``shard.split_times`` inside the snapshot (a split by time)."""
    if not cfg.shard.split_times:
        return None
    cuts: dict[int, list[int]] = {p: [] for p in ranges}
    for when in cfg.shard.split_times:
        found = offsets_at(cfg.kafka, str(cfg.source.topic), when, ranges)
        for p, (start, stop) in ranges.items():
            cuts[p].append(stop if found[p] is None else min(max(found[p], start), stop))
    return cuts


def _key_runs(cfg: KbitConfig, ranges: dict[int, tuple[int, int]]) -> dict[int, list[tuple[int, int, int]]]:
    """partition -> its records' runs by the split their message key hashes to (a split by key hash): the keys are
    read once here, a block at a time, so training reads values only. A record without a key is refused in one
    line."""
    topic = str(cfg.source.topic)
    runs = {}
    with RangeReader(cfg.kafka, cfg.reader, topic, None, metadata=True) as reader:
        for p, (start, stop) in sorted(ranges.items()):
            offsets: list[int] = []
            splits: list[int] = []
            blocks = [OffsetRange(p, a, min(a + KEY_READ_BLOCK, stop)) for a in range(start, stop, KEY_READ_BLOCK)]
            for _, records in reader.read_raw(blocks):
                keys = [r.key for r in records]  # type: ignore[attr-defined]  # metadata=True: MessageRecords
                if None in keys:
                    raise ConfigError(
                        f"shard.split_by=key_hash: topic {topic!r} partition {p} offset "
                        f"{records[keys.index(None)].offset} has no message key, so no key to keep in one split; "
                        "give every record a key, or split by ratio or time (shard.split_by)"
                    )
                offsets += [r.offset for r in records]
                splits += key_hash_splits(keys, cfg.shard.split_rates, cfg.shard.seed).tolist()
            runs[p] = split_runs(offsets, splits, start, stop)
    return runs


def _classes(
    cfg: KbitConfig, mapping: MappingConfig, decoder: RecordDecoder, ranges: dict[int, tuple[int, int]]
) -> tuple[list[str] | None, int]:
    """(label vocabulary, number of classes): as the mapping gives them, else read from every label."""
    if mapping.vocabulary is not None:
        return mapping.vocabulary, mapping.num_classes or len(mapping.vocabulary)
    if mapping.num_classes is not None:
        return None, mapping.num_classes
    labels = set()
    from_message = is_message_field(mapping.label)  # @key or @header.NAME: the consumer carries them

    def label_column(records: Sequence[RawRecord]) -> list[Any]:
        if from_message:
            return message_columns(records, [mapping.label], mapping)[mapping.label]
        return decoder.decode_columns([r.value for r in records], [mapping.label])[mapping.label]

    with RangeReader(cfg.kafka, cfg.reader, str(cfg.source.topic), None, metadata=from_message) as reader:
        blocks = [OffsetRange(p, start, stop) for p, (start, stop) in ranges.items() if stop > start]
        for _, records in reader.read_raw(blocks):
            labels.update(_labels(cfg, label_column, records))
    labels.discard(None)  # a record without a label is a bad record when read, not a class
    if all(type(label) is int for label in labels) and labels:
        return None, max(2, max(labels) + 1)
    if all(isinstance(label, str) for label in labels) and labels:
        vocabulary = sorted(labels)
        log.info("topic %s: label vocabulary discovered: %s", cfg.source.topic, vocabulary)
        return vocabulary, max(2, len(vocabulary))
    raise ConfigError(
        f"source.mapping.label {mapping.label!r} of topic {cfg.source.topic!r} holds neither only integers nor only "
        f"strings ({sorted(map(repr, labels))[:5]}); set source.mapping.vocabulary or num_classes"
    )


def _labels(
    cfg: KbitConfig, label_column: Callable[[Sequence[RawRecord]], list[Any]], records: Sequence[RawRecord]
) -> list[Any]:
    """The labels of ``records``; a record whose label does not decode fails naming it, or under
    ``reader.bad_records: skip`` is left out (the reader counts it when the run reads it)."""
    try:
        return list(label_column(records))
    except (CorruptRecordError, ValueError):  # ValueError: a key or header that does not read as its format
        pass  # one by one below, to name or skip the culprits
    labels = []
    for record in records:
        try:
            labels += label_column([record])
        except (CorruptRecordError, ValueError) as exc:
            if cfg.reader.bad_records == "fail":
                raise CorruptRecordError(
                    f"reading the labels of topic {cfg.source.topic!r} for its vocabulary: {exc}",
                    partition=record.partition,
                    offset=record.offset,
                ) from None
    return labels


def check_mapping(cfg: KbitConfig, manifest: Manifest) -> None:
    """ConfigError in one line when the mapping does not fit: against the decoder's writer schema when it has one
    (naming the field, subject and schema id), else against the first records of the snapshot."""
    assert manifest.source is not None
    codec = manifest_codec(manifest, "stock", cfg.registry)
    schema = codec.decoder.writer_schema()
    if schema is not None:
        check_against_schema(manifest.source.mapping, schema)
        return
    first = next((p for p in manifest.partitions if p.num_messages), None)
    if first is None:
        raise ConfigError(f"the snapshot of topic {manifest.topic!r} holds no record")
    sample = OffsetRange(
        first.partition, first.first_offset, first.first_offset + min(SAMPLE_RECORDS, first.num_messages)
    )
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        _, records = next(reader.read_raw([sample]))
    failing = [
        (p, reason) for p, reason in codec.failing_values(codec.decode_inputs(records)) if not codec.skips(reason)
    ]
    skipped = cfg.reader.bad_records == "skip" and len(failing) < len(records)
    if failing and not skipped:
        position, reason = failing[0]
        raise ConfigError(
            f"source.mapping does not fit topic {manifest.topic!r} partition {first.partition} offset "
            f"{records[position].offset}: {reason}"
        )
    if failing:
        log.warning(
            "topic %s: %d of the first %d records do not fit source.mapping (reader.bad_records: skip skips them)",
            manifest.topic,
            len(failing),
            len(records),
        )


def _wanted_kinds(mapping: MappingConfig) -> list[tuple[str, tuple[str, ...]]]:
    """Each mapped path with the kinds of field its use takes."""
    feature_kinds = _FEATURE_KINDS[mapping.encoding] if len(mapping.features) == 1 else _SCALAR_KINDS
    return [(path, feature_kinds) for path in mapping.features] + [(mapping.label, _LABEL_KINDS)]


def check_message_fields(mapping: MappingConfig) -> None:
    """ConfigError naming the field when a message's key, header or timestamp, as its format reads it, does not
    fit its use (e.g. a label from @key read as bytes)."""
    for path, kinds in _wanted_kinds(mapping):
        if not is_message_field(path):
            continue
        kind = message_field_kind(path, mapping)
        if kind not in kinds:
            which = "key_format" if path == KEY_FIELD else "header_format"
            read_as = "" if path == TIMESTAMP_FIELD else f" (source.mapping.{which}: {getattr(mapping, which)})"
            raise ConfigError(
                f"source.mapping: field {path!r} is {kind}{read_as}, the mapping needs {' or '.join(kinds)}"
            )


def check_against_schema(mapping: MappingConfig, schema: WriterSchema) -> None:
    """ConfigError naming the field, subject and schema id when a mapped field of the value is missing or of the wrong
    kind (the message's key, headers and timestamp are not in it: see check_message_fields)."""
    where = f"(subject {schema.subject}, schema id {schema.schema_id}; {schema.source})"
    for path, kinds in _wanted_kinds(mapping):
        if is_message_field(path):
            continue
        field = schema.fields.get(path)
        if field is None:
            raise ConfigError(f"source.mapping: field {path!r} is not in the writer schema {where}")
        if field.kind not in kinds:
            raise ConfigError(
                f"source.mapping: field {path!r} is {field.kind} in the writer schema, the mapping needs "
                f"{' or '.join(kinds)} {where}"
            )

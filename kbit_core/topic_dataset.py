"""A topic kbit did not write, as a dataset: its snapshot manifest (taken, or reused while the topic still holds it),
its label vocabulary discovered when needed, and its mapping checked before any rank starts.

The snapshot is saved as the topic's manifest in the workdir and recorded in the broker's manifest registry, so
another run or workdir reuses it; it is marked as not kbit's (``Manifest.source``), so no kbit command deletes,
recreates or writes the topic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kbit_core.config import DataVariant, KbitConfig, MappingConfig
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ConfigError, CorruptRecordError, KbitError, ManifestMismatchError
from kbit_core.formats.decoders import make_record_decoder
from kbit_core.formats.records import RecordDecoder, WriterSchema
from kbit_core.kafka import manifest_registry
from kbit_core.kafka.consumers import RawRecord
from kbit_core.kafka.manifest import DatasetInfo, Manifest, PartitionManifest, TopicSnapshot, manifest_codec
from kbit_core.kafka.manifest import manifest_path as manifest_file
from kbit_core.kafka.snapshot import moved_on, offsets_at, snapshot_ranges, topic_offsets
from kbit_core.produce import kbit_version, record_manifest
from kbit_core.sharding import OffsetRange

log = logging.getLogger(__name__)

# Records decoded at preflight to check a mapping against values without a schema (plain JSON).
SAMPLE_RECORDS = 64
# Kinds of a writer schema's field each use of it takes (see formats.records.FIELD_KINDS).
_FEATURE_KINDS = {"array": ("array<int>", "array<float>"), "bytes": ("bytes",), "base64": ("string",)}
_SCALAR_KINDS = ("int", "float", "bool")
_LABEL_KINDS = ("int", "string")


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
    src = cfg.source
    return {
        "at": src.at,
        "ranges": src.ranges,
        "value_format": src.value_format,
        "value_options": src.value_options,
        "mapping": src.mapping,
        "split_times": cfg.shard.split_times,
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


def _classes(
    cfg: KbitConfig, mapping: MappingConfig, decoder: RecordDecoder, ranges: dict[int, tuple[int, int]]
) -> tuple[list[str] | None, int]:
    """(label vocabulary, number of classes): as the mapping gives them, else read from every label."""
    if mapping.vocabulary is not None:
        return mapping.vocabulary, mapping.num_classes or len(mapping.vocabulary)
    if mapping.num_classes is not None:
        return None, mapping.num_classes
    labels = set()
    with RangeReader(cfg.kafka, cfg.reader, str(cfg.source.topic), None) as reader:
        blocks = [OffsetRange(p, start, stop) for p, (start, stop) in ranges.items() if stop > start]
        for _, records in reader.read_raw(blocks):
            labels.update(_labels(cfg, decoder, mapping.label, records))
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


def _labels(cfg: KbitConfig, decoder: RecordDecoder, path: str, records: Sequence[RawRecord]) -> list[Any]:
    """The labels of ``records``; a record whose value does not decode fails naming it, or under
    ``reader.bad_records: skip`` is left out (the reader counts it when the run reads it)."""
    try:
        return list(decoder.decode_columns([r.value for r in records], [path])[path])
    except CorruptRecordError:
        pass  # one by one below, to name or skip the culprits
    labels = []
    for record in records:
        try:
            labels += decoder.decode_columns([record.value], [path])[path]
        except CorruptRecordError as exc:
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
    failing = [(p, reason) for p, reason in codec.failing_values([r.value for r in records]) if not codec.skips(reason)]
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


def check_against_schema(mapping: MappingConfig, schema: WriterSchema) -> None:
    """ConfigError naming the field, subject and schema id when a mapped field is missing or of the wrong kind."""
    where = f"(subject {schema.subject}, schema id {schema.schema_id}; {schema.source})"
    feature_kinds = _FEATURE_KINDS[mapping.encoding] if len(mapping.features) == 1 else _SCALAR_KINDS
    wanted = [(path, feature_kinds) for path in mapping.features] + [(mapping.label, _LABEL_KINDS)]
    for path, kinds in wanted:
        field = schema.fields.get(path)
        if field is None:
            raise ConfigError(f"source.mapping: field {path!r} is not in the writer schema {where}")
        if field.kind not in kinds:
            raise ConfigError(
                f"source.mapping: field {path!r} is {field.kind} in the writer schema, the mapping needs "
                f"{' or '.join(kinds)} {where}"
            )

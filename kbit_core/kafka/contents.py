"""Whether a topic holds what its manifest recorded: the same partitions and offsets, and the same messages, not just
as many of them.

Offsets alone cannot tell: drop one record and duplicate another and every offset still matches. Each
partition's manifest keeps a content digest (:func:`~kbit_core.kafka.manifest.record_digest`, summed over its
messages at their offsets); this module reads the manifest's ranges once and compares. Where a digest differs it
also names the first message out of place, from the order kbit produces in (message m is keyed by its first
record index and goes to partition m % P).

Reading a whole topic on every reuse costs as much as fetching it, so a check that found the records exact is
remembered beside the manifest, keyed by the topic's id and its partitions' earliest and end offsets: a Kafka log
is append-only, so while none of those moved (a topic deleted and made again gets a new id), the records have not
changed and are not read again. A topic whose broker reports no id is read every time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient

from kbit_core.config import KafkaConfig
from kbit_core.kafka import admin, offsets
from kbit_core.kafka.clients import ConsumerUse, client_options, open_consumer
from kbit_core.kafka.manifest import Manifest, PartitionManifest, digest_hex, message_digest, record_digest

log = logging.getLogger(__name__)

# A read that makes no progress for this long is reported instead of waited out.
STALL_S = 10.0
# Kafka's "no id" (a broker that does not report topic ids).
NULL_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


@dataclasses.dataclass
class _PartitionRead:
    spec: PartitionManifest
    next_offset: int
    total: int = 0
    misplaced: str | None = None  # the first message out of place, in words

    @property
    def done(self) -> bool:
        return self.next_offset >= self.spec.stop_offset


@dataclasses.dataclass(frozen=True)
class TopicCheck:
    """What the broker holds for a manifest's topic, and every way it differs from the manifest."""

    topic: str
    exists: bool
    partitions: list[int] = dataclasses.field(default_factory=list)
    earliest: dict[int, int] = dataclasses.field(default_factory=dict)
    ends: dict[int, int] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    differing: frozenset[int] = frozenset()  # manifest partitions that are missing or differ on the broker

    @property
    def holds_manifest(self) -> bool:
        return self.exists and not self.problems


def check_topic(kcfg: KafkaConfig, manifest: Manifest) -> TopicCheck:
    """Compare the live topic with ``manifest``: same partitions, every offset still stored, nothing appended."""
    topic = manifest.topic
    expected = [p.partition for p in manifest.partitions]
    if not admin.topic_exists(kcfg, topic):
        missing = f"topic {topic!r} does not exist on the {admin.describe_broker(kcfg)}"
        return TopicCheck(topic, exists=False, problems=[missing], differing=frozenset(expected))
    present = admin.topic_partitions(kcfg, topic)
    problems = [] if present == expected else [f"partitions: the broker has {present}, the manifest has {expected}"]
    differing = set(expected) - set(present)
    shared = [p for p in manifest.partitions if p.partition in present]
    earliest = offsets.earliest_offsets(kcfg, topic, [p.partition for p in shared])
    ends = offsets.exact_end_offsets(kcfg, topic, [p.partition for p in shared])
    for part in shared:
        if ends[part.partition] != part.stop_offset:
            problems.append(
                f"partition {part.partition}: the broker ends at offset {ends[part.partition]}, "
                f"the manifest at {part.stop_offset}"
            )
            differing.add(part.partition)
        if part.num_messages and earliest[part.partition] > part.first_offset:
            gone_to = min(earliest[part.partition], part.stop_offset) - 1
            problems.append(
                f"partition {part.partition}: offsets {part.first_offset}..{gone_to} of the manifest's "
                f"{part.first_offset}..{part.last_offset} are gone (the log starts at {earliest[part.partition]}: "
                f"retention or DeleteRecords removed them)"
            )
            differing.add(part.partition)
    return TopicCheck(topic, True, present, earliest, ends, problems, frozenset(differing))


def expected_key(manifest: Manifest, partition: int, offset: int) -> bytes:
    """The key kbit's producer gave the message at ``offset`` of ``partition``: its first record's index."""
    spec = manifest.partitions[partition]
    message_no = (offset - spec.first_offset) * len(manifest.partitions) + partition
    return str(message_no * manifest.variant.records_per_message).encode("ascii")


def check_records(kcfg: KafkaConfig, manifest: Manifest) -> dict[int, str]:
    """partition -> how its records differ from the manifest's digest; empty when every digested partition holds
    exactly its records. Partitions without a digest (older manifests) are not read."""
    reads = {
        p.partition: _PartitionRead(p, p.first_offset)
        for p in manifest.partitions
        if p.num_messages and p.content_digest is not None
    }
    if not reads:
        return {}
    stalled = _read_all(kcfg, manifest, reads)
    problems: dict[int, str] = {}
    for partition, read in reads.items():
        if partition in stalled:
            problems[partition] = (
                f"partition {partition}: reading stopped at offset {read.next_offset} (no record for {STALL_S:g} s)"
            )
        elif digest_hex(read.total) != read.spec.content_digest:
            where = read.misplaced or "a record's contents changed"
            problems[partition] = f"partition {partition}: the records differ from the manifest's ({where})"
    return problems


def _read_all(kcfg: KafkaConfig, manifest: Manifest, reads: dict[int, _PartitionRead]) -> set[int]:
    """Read every range into ``reads``; returns the partitions whose reading stalled."""
    admin.require_embedded_listening(kcfg)
    consumer = open_consumer(kcfg, ConsumerUse(purpose="contents"))
    try:
        consumer.assign([TopicPartition(manifest.topic, p, read.next_offset) for p, read in reads.items()])
        last_progress = time.monotonic()
        while not all(read.done for read in reads.values()):
            if time.monotonic() - last_progress > STALL_S:
                return {p for p, read in reads.items() if not read.done}
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise admin.unreachable(kcfg, f"reading {manifest.topic}: {msg.error().str()}")
                    continue
                read = reads.get(msg.partition())
                if read is not None and read.next_offset <= msg.offset() < read.spec.stop_offset:
                    _take(manifest, read, msg.offset(), msg.key(), msg.value())
                    last_progress = time.monotonic()
        return set()
    finally:
        consumer.close()


def _take(manifest: Manifest, read: _PartitionRead, offset: int, key: bytes | None, value: bytes | None) -> None:
    read.total += record_digest(offset, message_digest(key, value))
    if read.misplaced is None:
        expected = expected_key(manifest, read.spec.partition, offset)
        if offset != read.next_offset:
            read.misplaced = f"offset {read.next_offset} is missing"
        elif key != expected:
            found = key.decode("ascii", "replace") if key else "no key"
            read.misplaced = (
                f"offset {offset} holds the message of record {found}, where the manifest has record "
                f"{expected.decode()}"
            )
    read.next_offset = offset + 1


def check_topic_and_records(kcfg: KafkaConfig, manifest: Manifest, verified_at: Path | None = None) -> TopicCheck:
    """:func:`check_topic`, then, when the offsets match, :func:`check_records` — unless ``verified_at``
    records that an earlier check found these records exact and the topic's state has not moved since."""
    check = check_topic(kcfg, manifest)
    if not check.holds_manifest:
        return check
    state = topic_state(kcfg, manifest, check) if verified_at is not None else None
    if state is not None and _load_json(verified_at) == state:
        log.info("topic %s: records verified before (same topic id and offsets), not read again", manifest.topic)
        return check
    differing = check_records(kcfg, manifest)
    if state is not None and not differing:
        verified_at.parent.mkdir(parents=True, exist_ok=True)
        verified_at.write_text(json.dumps(state, sort_keys=True))
    return dataclasses.replace(
        check,
        problems=[*check.problems, *differing.values()],
        differing=check.differing | frozenset(differing),
    )


def topic_state(kcfg: KafkaConfig, manifest: Manifest, check: TopicCheck) -> dict[str, Any] | None:
    """What must stay the same for ``manifest``'s records to be unchanged: the topic's id, every partition's
    earliest and end offset, and the manifest itself; None when the broker reports no topic id."""
    client = AdminClient(client_options(kcfg))
    future = client.describe_topics(TopicCollection([manifest.topic]), request_timeout=kcfg.request_timeout_s)
    try:
        topic_id = str(future[manifest.topic].result().topic_id or "")
    except KafkaException:
        return None  # not answered: read the records instead
    if topic_id in ("", NULL_TOPIC_ID):
        return None
    return {
        "topic_id": topic_id,
        "earliest": {str(p): o for p, o in sorted(check.earliest.items())},
        "ends": {str(p): o for p, o in sorted(check.ends.items())},
        "manifest": manifest.model_dump(mode="json"),
    }


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

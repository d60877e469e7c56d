"""What a topic kbit did not write holds, read without touching it: its id, every partition's offsets (now, at a
time, or as asked), its first and last records' times, and whether it moved on since a snapshot was taken."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from datetime import datetime

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient

from kbit_core.config import KafkaConfig
from kbit_core.errors import TopicError
from kbit_core.kafka import admin
from kbit_core.kafka.clients import ConsumerUse, client_options, open_consumer
from kbit_core.kafka.contents import NULL_TOPIC_ID
from kbit_core.kafka.manifest import Manifest
from kbit_core.sharding import parse_offset_strings

# How long the first and last records of every partition are waited for (inspect).
EDGE_READ_S = 5.0


@dataclasses.dataclass(frozen=True)
class TopicOffsets:
    """One look at a topic: its id and each partition's stored offsets ``[low, high)``."""

    topic: str
    topic_id: str | None
    bounds: dict[int, tuple[int, int]]


def topic_id(kcfg: KafkaConfig, topic: str) -> str | None:
    """The broker's id of ``topic``; None when it reports none."""
    client = AdminClient(client_options(kcfg))
    future = client.describe_topics(TopicCollection([topic]), request_timeout=kcfg.request_timeout_s)
    try:
        found = str(future[topic].result().topic_id or "")
    except KafkaException as exc:
        raise admin.unreachable(kcfg, f"describing topic {topic}: {exc.args[0].str()}") from None
    return None if found in ("", NULL_TOPIC_ID) else found


def topic_offsets(kcfg: KafkaConfig, topic: str) -> TopicOffsets:
    """``topic``'s id and every partition's (earliest, end) offsets; TopicError when it does not exist."""
    if not admin.topic_exists(kcfg, topic):
        raise TopicError(f"topic {topic!r} does not exist on the {admin.describe_broker(kcfg)}")
    partitions = admin.topic_partitions(kcfg, topic)
    consumer = _consumer(kcfg)
    try:
        bounds = admin.list_offsets(consumer, kcfg, topic, partitions)
    finally:
        consumer.close()
    return TopicOffsets(topic, topic_id(kcfg, topic), bounds)


def offsets_at(kcfg: KafkaConfig, topic: str, when: datetime, partitions: Iterable[int]) -> dict[int, int | None]:
    """partition -> the first offset whose record's timestamp is at or after ``when``; None where no record is."""
    millis = int(when.timestamp() * 1000)
    consumer = _consumer(kcfg)
    try:
        found = consumer.offsets_for_times(
            [TopicPartition(topic, p, millis) for p in partitions], timeout=kcfg.request_timeout_s
        )
    except KafkaException as exc:
        raise admin.unreachable(kcfg, f"offsets of {topic} at {when.isoformat()}: {exc.args[0].str()}") from None
    finally:
        consumer.close()
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in found}


def snapshot_ranges(
    kcfg: KafkaConfig, offsets: TopicOffsets, at: datetime | None, ranges: list[str] | None
) -> dict[int, tuple[int, int]]:
    """partition -> half-open (start, stop) of the snapshot: every stored record, those before ``at``, or
    ``ranges`` (inclusive 'partition:first:last'; partitions left out are empty), checked against the bounds."""
    bounds = offsets.bounds
    if ranges is not None:
        try:
            asked = parse_offset_strings(ranges)
        except ValueError as exc:
            raise TopicError(f"source.ranges: {exc}") from None
        admin.require_partitions(offsets.topic, asked, list(bounds))
        for p, (start, stop) in asked.items():
            low, high = bounds[p]
            if stop > start and (start < low or stop > high):
                raise TopicError(
                    f"source.ranges: topic {offsets.topic!r} partition {p} stores offsets [{low}, {high}), "
                    f"not all of [{start}, {stop})"
                )
        return {p: asked.get(p, (low, low)) for p, (low, _) in bounds.items()}
    if at is None:
        return dict(bounds)
    stops = offsets_at(kcfg, offsets.topic, at, bounds)
    return {p: (low, high if stops[p] is None else max(low, min(stops[p], high))) for p, (low, high) in bounds.items()}


def moved_on(kcfg: KafkaConfig, manifest: Manifest) -> list[str]:
    """Every way ``manifest``'s topic no longer holds the snapshot (records deleted below it, a recreated topic,
    partitions gone, a compacted log); empty when every snapshotted offset is still stored as it was."""
    topic = manifest.topic
    assert manifest.source is not None
    if not admin.topic_exists(kcfg, topic):
        return [f"topic {topic!r} no longer exists on the {admin.describe_broker(kcfg)}"]
    now = topic_offsets(kcfg, topic)
    problems = []
    if manifest.source.topic_id is not None and now.topic_id != manifest.source.topic_id:
        problems.append(
            f"the topic was deleted and created again (id {now.topic_id}, the snapshot's {manifest.source.topic_id})"
        )
    for part in manifest.partitions:
        if part.partition not in now.bounds:
            problems.append(f"partition {part.partition} is gone")
            continue
        low, high = now.bounds[part.partition]
        if part.num_messages and low > part.first_offset:
            problems.append(
                f"partition {part.partition}: offsets {part.first_offset}..{min(low, part.stop_offset) - 1} are "
                f"deleted (retention or DeleteRecords; the log starts at {low})"
            )
        elif part.num_messages and high < part.stop_offset:
            problems.append(
                f"partition {part.partition} ends at offset {high}, before the snapshot's {part.stop_offset}"
            )
    if "compact" in admin.topic_config(kcfg, topic).get("cleanup.policy", ""):
        problems.append("its cleanup.policy compacts it: records inside the snapshot may be removed")
    return problems


def edge_timestamps(kcfg: KafkaConfig, topic: str, bounds: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """partition -> (timestamp ms of its first stored record, of its last), for partitions holding records; those
    not read within EDGE_READ_S are left out."""
    wanted = {p: (low, high - 1) for p, (low, high) in bounds.items() if high > low}
    first = _timestamps_at(kcfg, topic, {p: low for p, (low, _) in wanted.items()})
    last = _timestamps_at(kcfg, topic, {p: last for p, (_, last) in wanted.items()})
    return {p: (first[p], last[p]) for p in wanted if p in first and p in last}


def _timestamps_at(kcfg: KafkaConfig, topic: str, offsets: Mapping[int, int]) -> dict[int, int]:
    """partition -> timestamp ms of the first record at or after its offset in ``offsets``."""
    if not offsets:
        return {}
    consumer = _consumer(kcfg)
    found: dict[int, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in offsets.items()])
        deadline = time.monotonic() + EDGE_READ_S
        while len(found) < len(offsets) and time.monotonic() < deadline:
            for msg in consumer.consume(len(offsets), 0.2):
                error = msg.error()
                if error is None and msg.partition() not in found:
                    found[msg.partition()] = msg.timestamp()[1]
                elif error is not None and error.code() != KafkaError._PARTITION_EOF:
                    raise admin.unreachable(kcfg, f"reading {topic}: {error.str()}")
    finally:
        consumer.close()
    return found


def _consumer(kcfg: KafkaConfig) -> Consumer:
    """An assign-only consumer that never joins a group nor commits (kbit never writes a user's topic's groups)."""
    admin.require_embedded_listening(kcfg)
    # a record asked for at an offset retention has just deleted: read from the earliest still stored instead
    use = ConsumerUse("snapshot", reset_is_error=False, partition_eof=True, tuning={"auto.offset.reset": "earliest"})
    return open_consumer(kcfg, use)

"""Tansu's workaround: exact log bounds from the watermarks of one Fetch response.

Tansu 0.6.0 answers ListOffsets(LATEST) with "base offset of the last batch + 1", which is short whenever the last
batch holds more than one record; the high watermark carried by every Fetch response is right, so on Tansu
:func:`kbit_core.kafka.offsets.offset_bounds` fetches once near the end of each partition and reads the watermarks
that came back. (Tansu's other quirks stay beside the code they bend: ``admin.topic_partitions`` asks for every
topic because Tansu's admin metadata request would create one it names.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kbit_core.config import KafkaConfig
from kbit_core.errors import TopicError
from kbit_core.kafka import admin

# How long one poll waits for a bounds probe's answer (a fetch answered with nothing raises no event to return on):
# briefly while an answer is due, then longer, so a broker that is down is not asked a thousand times a second.
PROBE_POLL_S = 0.001
PROBE_DUE_S = 0.05
SLOW_PROBE_POLL_S = 0.05


def fetch_bounds(
    consumer: Consumer,
    kcfg: KafkaConfig,
    topic: str,
    probes: Mapping[int, int],
    meanwhile: Callable[[], object] | None = None,
    client_error: Callable[[], str | None] = lambda: None,
) -> dict[int, tuple[int, int]]:
    """partition -> (earliest stored offset, exact log end) from one Fetch at ``probes`` (a partition -> offset
    expected to be at most its log end): the response carries the log start offset and the high watermark, which
    is exact where ListOffsets(LATEST) is not (Tansu). ``consumer`` holds no assignment afterwards.

    The fetch is assigned before the metadata request that checks the partitions, so both round trips overlap (and
    ``meanwhile``, run right after the assignment, with them: librdkafka works on threads of its own). A probe the
    broker answers as out of range (Apache Kafka; Tansu answers with the bounds regardless) is asked with
    ListOffsets, then probed again just below the approximate end. ``client_error`` gives the latest client-level
    error for the timeout message.

    Raises:
        TopicError: the topic or one of the partitions does not exist.
    """
    consumer.assign([TopicPartition(topic, p, o) for p, o in probes.items()])
    try:
        if meanwhile is not None:
            meanwhile()
        admin.require_partitions(topic, probes, admin.consumer_partitions(consumer, kcfg, topic))
        bounds = _await_watermarks(consumer, kcfg, topic, probes, client_error)
        outside = [p for p in probes if p not in bounds]
        if outside:
            listed = admin.list_offsets(consumer, kcfg, topic, outside)
            below_end = {p: max(low, high - 1) for p, (low, high) in listed.items()}
            consumer.assign([TopicPartition(topic, p, o) for p, o in below_end.items()])
            again = _await_watermarks(consumer, kcfg, topic, below_end, client_error)
            if len(again) < len(outside):
                raise admin.unreachable(
                    kcfg,
                    f"{topic} partition(s) {sorted(set(outside) - set(again))} answer a fetch "
                    f"below their listed end offset as out of range",
                )
            bounds.update({p: (listed[p][0], again[p][1]) for p in outside})
        unknown_start = [p for p, (low, _) in bounds.items() if low < 0]
        if unknown_start:  # the Fetch response had no log start offset (before Fetch v5)
            listed = admin.list_offsets(consumer, kcfg, topic, unknown_start)
            bounds.update({p: (listed[p][0], bounds[p][1]) for p in unknown_start})
        return bounds
    finally:
        consumer.assign([])


def _await_watermarks(
    consumer: Consumer,
    kcfg: KafkaConfig,
    topic: str,
    partitions: Mapping[int, int],
    client_error: Callable[[], str | None],
) -> dict[int, tuple[int, int]]:
    """partition -> (log start offset or -1, high watermark) from the first Fetch response of each assigned
    partition, leaving out those answered as out of range. A poll returns at the first record or error, and a
    fetch answered with nothing at the log end raises no event, so the polls are short rather than waiting."""
    started = time.monotonic()
    deadline, outside, last_error = started + kcfg.request_timeout_s, set(), None
    while True:
        marks = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
            for p in partitions
            if p not in outside
        }
        if all(high >= 0 for _, high in marks.values()):
            return marks
        if time.monotonic() > deadline:
            waiting = sorted(p for p, (_, high) in marks.items() if high < 0)
            raise admin.unreachable(
                kcfg,
                f"no fetch response for {topic} partition(s) {waiting} within "
                f"{kcfg.request_timeout_s:g}s; last client error: "
                f"{last_error or client_error() or 'none'}",
            )
        due = time.monotonic() - started < PROBE_DUE_S
        for msg in consumer.consume(1, PROBE_POLL_S if due else SLOW_PROBE_POLL_S):
            err = msg.error()
            if err is None or err.code() == KafkaError._PARTITION_EOF:
                continue
            if err.code() in admin.OUT_OF_RANGE:
                outside.update([msg.partition()] if msg.partition() in partitions else partitions)
            elif err.code() in admin.UNKNOWN_PARTITION:
                raise TopicError(f"topic {topic!r} partition {msg.partition()}: {err.str()}")
            else:  # transport trouble may heal before the deadline
                last_error = err.str()

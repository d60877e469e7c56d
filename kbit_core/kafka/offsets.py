"""Exact log bounds on every broker: the first offset still stored and the log end of a topic's partitions.

Apache Kafka answers ListOffsets(EARLIEST/LATEST) exactly, so :func:`offset_bounds` asks it there; on Tansu
(``kcfg.tansu``), whose ListOffsets(LATEST) may be short, the bounds come from :mod:`kbit_core.kafka.tansu`'s Fetch
probe. Keep every end-offset lookup behind :func:`offset_bounds` or :func:`exact_end_offsets`, which choose per broker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from confluent_kafka import Consumer

from kbit_core.config import KafkaConfig
from kbit_core.kafka import admin, tansu
from kbit_core.kafka.clients import ConsumerUse, open_consumer


def _offset_consumer(kcfg: KafkaConfig) -> Consumer:
    admin.require_embedded_listening(kcfg)
    # a probe outside the log is answered as such (the use's default), never moved silently
    use = ConsumerUse(
        purpose="offsets",
        partition_eof=True,
        fetch_wait_ms=10,
        fetch_max_bytes=1024 * 1024,
        partition_fetch_bytes=64 * 1024,
    )
    return open_consumer(kcfg, use)


def _checked_partitions(kcfg: KafkaConfig, topic: str, partitions: Iterable[int]) -> list[int]:
    return admin.require_partitions(topic, partitions, admin.topic_partitions(kcfg, topic))


def earliest_offsets(kcfg: KafkaConfig, topic: str, partitions: Iterable[int] | None = None) -> dict[int, int]:
    """partition -> first offset still stored (ListOffsets(EARLIEST) is correct on every broker)."""
    parts = _checked_partitions(
        kcfg, topic, partitions if partitions is not None else admin.topic_partitions(kcfg, topic)
    )
    consumer = _offset_consumer(kcfg)
    try:
        return {p: low for p, (low, _) in admin.list_offsets(consumer, kcfg, topic, parts).items()}
    finally:
        consumer.close()


def exact_end_offsets(kcfg: KafkaConfig, topic: str, partitions: Iterable[int] | None = None) -> dict[int, int]:
    """partition -> log-end offset (exclusive): ListOffsets(LATEST), or on Tansu (``kcfg.tansu``), whose answer may
    be short, the high watermark of a real Fetch response."""
    parts = _checked_partitions(
        kcfg, topic, partitions if partitions is not None else admin.topic_partitions(kcfg, topic)
    )
    consumer = _offset_consumer(kcfg)
    try:
        if not kcfg.tansu:
            return {p: high for p, (_, high) in admin.list_offsets(consumer, kcfg, topic, parts).items()}
        # just below the approximate end: the response comes at once with the last batch, not after a fetch wait
        probes = {p: max(low, high - 1) for p, (low, high) in admin.list_offsets(consumer, kcfg, topic, parts).items()}
        return {p: end for p, (_, end) in tansu.fetch_bounds(consumer, kcfg, topic, probes).items()}
    finally:
        consumer.close()


def offset_bounds(
    consumer: Consumer,
    kcfg: KafkaConfig,
    topic: str,
    probes: Mapping[int, int],
    meanwhile: Callable[[], object] | None = None,
    client_error: Callable[[], str | None] = lambda: None,
) -> dict[int, tuple[int, int]]:
    """partition -> (earliest stored offset, exact log end) of each partition in ``probes`` (see
    :func:`kbit_core.kafka.tansu.fetch_bounds` for the arguments): ListOffsets on Apache Kafka, where it is exact; Tansu's short
    ListOffsets(LATEST) needs the fetch probe. ``consumer`` holds no assignment afterwards.

    Raises:
        TopicError: the topic or one of the partitions does not exist.
    """
    if kcfg.tansu:
        return tansu.fetch_bounds(consumer, kcfg, topic, probes, meanwhile, client_error)
    if meanwhile is not None:
        meanwhile()
    consumer.assign([])
    return admin.list_offsets(
        consumer, kcfg, topic, admin.require_partitions(topic, probes, admin.consumer_partitions(consumer, kcfg, topic))
    )

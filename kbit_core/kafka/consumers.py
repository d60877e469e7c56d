"""Consumer backends: read explicit partition offsets with confluent-kafka or kafka-python, errors as kbit errors.

No consumer-group semantics are used: partitions are assigned with explicit start offsets, nothing is
committed, and an offset outside the log is an error rather than a silent reset (the original's
``auto_offset_reset=earliest`` let reads land anywhere).
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from kbit_core.config import ClientName, KafkaConfig, ReaderConfig
from kbit_core.errors import BrokerError, ConfigError, OffsetRangeError
from kbit_core.kafka.admin import EAGER_CONNECT, client_options
from kbit_core.kafka.settings import kafka_python_options, mask

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 10


class RawRecord(NamedTuple):
    partition: int
    offset: int
    value: bytes | None


class ConsumerBackend(ABC):
    """One Kafka consumer reading explicitly assigned partitions of one topic.

    ``poll`` raises :class:`TopicError` / :class:`OffsetRangeError` for errors that retrying cannot fix,
    and :class:`BrokerError` for transport trouble the caller may retry.
    """

    client: ClientName
    topic: str | None = None

    @abstractmethod
    def assign(self, topic: str, starts: dict[int, int]) -> None:
        """Read ``topic`` from ``starts[partition]`` on each listed partition (replacing any assignment);
        an empty ``starts`` stops all fetching."""

    @abstractmethod
    def poll(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        """Up to ``max_records`` records (possibly none when ``timeout_s`` passes)."""

    @abstractmethod
    def position(self, partition: int) -> int | None:
        """The next offset this consumer will deliver from ``partition`` of the assigned topic (past records it
        delivered and control records it skipped), or None before the first fetch."""

    @abstractmethod
    def close(self) -> None: ...

    @property
    def last_error(self) -> str | None:
        """The latest client-level error (e.g. a lost connection), for timeout messages."""
        return None

    def __enter__(self) -> ConsumerBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _group_id() -> str:
    # A fresh group id per consumer: nothing is committed, and concurrent readers never rebalance each other.
    return f"kbit-reader-{uuid.uuid4().hex[:12]}"


class ConfluentConsumer(ConsumerBackend):
    client: ClientName = "confluent"

    def __init__(self, kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig) -> None:
        from confluent_kafka import Consumer

        self._last_error: str | None = None
        opts: dict[str, Any] = {
            **client_options(kafka_cfg),
            **EAGER_CONNECT,
            "group.id": _group_id(),
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "error",
            "enable.partition.eof": False,
            # The reader knows where its ranges end; a long poll at the log end would only delay the next
            # assign by up to 500 ms (measured: 0.5 s per re-seek with the default, ~15 ms with this).
            "fetch.wait.max.ms": FETCH_WAIT_MS,
            # Once the prefetch queue reaches its bounds librdkafka pauses fetching for this long (default 1 s)
            # even after the queue drains: measured one 1 s stall per 20k records, 28k instead of 500k records/s.
            "fetch.queue.backoff.ms": FETCH_WAIT_MS,
            # Bound librdkafka's prefetch queue so memory stays flat however large the topic is.
            "fetch.max.bytes": reader_cfg.fetch_max_bytes,
            "max.partition.fetch.bytes": reader_cfg.fetch_max_bytes,
            "queued.max.messages.kbytes": max(1, 2 * reader_cfg.fetch_max_bytes // 1024),
            "queued.min.messages": max(1000, 4 * reader_cfg.max_poll_records),
            "error_cb": self._on_error,
        }
        log.debug("confluent consumer options: %s", mask({k: v for k, v in opts.items() if not callable(v)}))
        self._consumer = Consumer(opts)

    def _on_error(self, err: Any) -> None:
        # Transport errors arrive here, not from consume(); keep the latest for the caller's timeout message.
        self._last_error = str(err)
        log.debug("confluent client error: %s", err)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def assign(self, topic: str, starts: dict[int, int]) -> None:
        from confluent_kafka import TopicPartition

        self.topic = topic
        self._consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])

    def poll(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        from confluent_kafka import KafkaError

        out: list[RawRecord] = []
        for msg in self._consumer.consume(num_messages=max_records, timeout=timeout_s):
            err = msg.error()
            if err is None:
                out.append(RawRecord(msg.partition(), msg.offset(), msg.value()))
                continue
            code, where = err.code(), {"topic": msg.topic() or self.topic, "partition": msg.partition()}
            if code == KafkaError._PARTITION_EOF:
                continue
            if code == KafkaError.OFFSET_OUT_OF_RANGE or code == KafkaError._AUTO_OFFSET_RESET:
                raise OffsetRangeError(f"offset out of range: {err.str()}", offset=msg.offset(), **where)
            if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC):
                raise OffsetRangeError(f"unknown topic or partition: {err.str()}", **where)
            # Anything else (transport, leadership, timeouts) may heal: the reader retries until its deadline.
            raise BrokerError(f"consumer error on topic {where['topic']!r} partition {where['partition']}: "
                              f"{err.str()}")
        return out

    def position(self, partition: int) -> int | None:
        from confluent_kafka import TopicPartition

        (tp,) = self._consumer.position([TopicPartition(self.topic, partition)])
        return tp.offset if tp.offset >= 0 else None  # librdkafka's OFFSET_INVALID is negative

    def close(self) -> None:
        self._consumer.close()


class KafkaPythonConsumer(ConsumerBackend):
    client: ClientName = "kafka-python"

    def __init__(self, kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig) -> None:
        import kafka

        try:
            import crc32c  # noqa: F401  (kafka-python checks CRCs in pure Python without it: 10x slower)
        except ImportError:
            log.warning("the crc32c package is missing: kafka-python will verify CRCs very slowly")
        opts: dict[str, Any] = {
            **kafka_python_options(kafka_cfg),
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "none",
            "max_poll_records": reader_cfg.max_poll_records,
            "fetch_max_bytes": reader_cfg.fetch_max_bytes,
            "max_partition_fetch_bytes": reader_cfg.fetch_max_bytes,
            "fetch_max_wait_ms": FETCH_WAIT_MS,
            "client_id": _group_id(),
        }
        log.debug("kafka-python consumer options: %s", mask(opts))
        self._consumer = kafka.KafkaConsumer(**opts)

    def assign(self, topic: str, starts: dict[int, int]) -> None:
        from kafka import TopicPartition

        self.topic = topic
        tps = {p: TopicPartition(topic, p) for p in starts}
        self._consumer.assign(list(tps.values()))
        for p, offset in starts.items():
            self._consumer.seek(tps[p], offset)

    def poll(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        from kafka.errors import KafkaError, OffsetOutOfRangeError, UnknownTopicOrPartitionError

        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except OffsetOutOfRangeError as exc:
            tp_offsets = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
            tp, offset = next(iter(tp_offsets.items()), (None, None))
            raise OffsetRangeError(f"offset out of range: {exc}", topic=self.topic,
                                   partition=getattr(tp, "partition", None), offset=offset) from None
        except UnknownTopicOrPartitionError as exc:
            raise OffsetRangeError(f"unknown topic or partition: {exc}", topic=self.topic) from None
        except KafkaError as exc:  # transport and leadership trouble: the reader retries until its deadline
            raise BrokerError(f"consumer error on topic {self.topic!r}: {exc}") from None
        return [RawRecord(r.partition, r.offset, r.value) for recs in batches.values() for r in recs]

    def position(self, partition: int) -> int | None:
        from kafka import TopicPartition

        return self._consumer.position(TopicPartition(self.topic, partition), timeout_ms=0)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


_BACKENDS: dict[str, type[ConsumerBackend]] = {"confluent": ConfluentConsumer, "kafka-python": KafkaPythonConsumer}


def make_consumer(kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig, client: ClientName | None = None) -> ConsumerBackend:
    """A consumer for ``client`` (default ``kafka_cfg.client``) configured from the typed config."""
    name = client or kafka_cfg.client
    if name not in _BACKENDS:
        raise ConfigError(f"unknown Kafka client {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name](kafka_cfg, reader_cfg)

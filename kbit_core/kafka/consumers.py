"""Consumer backends: read explicit partition offsets with confluent-kafka or kafka-python, errors as kbit errors.

No consumer-group semantics are used: partitions are assigned with explicit start offsets, nothing is
committed, and an offset outside the log is an error rather than a silent reset (the original's
``auto_offset_reset=earliest`` let reads land anywhere). Both read committed records only.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# Both clients name their types alike (TopicPartition, KafkaError): used qualified by client.
import confluent_kafka
import kafka
import kafka.errors

from kbit_core.config import ClientName, KafkaConfig, ReaderConfig
from kbit_core.errors import BrokerError, ConfigError, OffsetRangeError
from kbit_core.kafka.admin import OUT_OF_RANGE, UNKNOWN_PARTITION
from kbit_core.kafka.clients import ConsumerUse, consumer_options, open_consumer
from kbit_core.kafka.offsets import offset_bounds

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 10
# The bounds check's probe fetch is answered after this wait when the plan reads to the log end, and leaves the
# confluent consumer fetching there, so its next assign waits for that fetch to come back (measured: the first
# range read after the check took 13-16 ms with 10 ms, 3-5 ms with 1 ms); an idle consumer at a log end then
# costs the broker ~11 % of a core instead of ~4 %, only while it sits there.
LOG_END_WAIT_MS = 1
# How long librdkafka waits before it looks again at a full prefetch queue (default 1 s). A full queue holds up the
# broker's whole fetch loop, so after a jump to another block the new block's first fetch waited out this backoff
# too (seen in librdkafka's fetch log: "Fetch backoff for 10ms: Local: Queue full" right after the assign); with
# 1 ms a block of 4,096 single-record messages arrived in 10.4 ms instead of 12.7 and a shuffled pass over 100,000
# took 0.32 s instead of 0.41 (medians of 6 alternated runs), for 1.2-1.4 % of a core instead of 0.2-0.4 % while a
# queue stays full behind a slower rank.
QUEUE_FULL_BACKOFF_MS = 1


class RawRecord(NamedTuple):
    partition: int
    offset: int
    value: bytes | None


class MessageRecord(NamedTuple):
    """A record with its key, headers and timestamp (ms; -1 when unavailable), polled only for a mapping that reads
    them (``source.mapping``'s @key, @header.NAME, @timestamp): the first three fields are a RawRecord's."""

    partition: int
    offset: int
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes | None]] | None
    timestamp: int


# RawRecord from a (partition, offset, value) tuple without a Python frame per record (NamedTuple's own __new__ is
# Python code); MessageRecord likewise
_AS_RAW_RECORD = functools.partial(tuple.__new__, RawRecord)
_AS_MESSAGE_RECORD = functools.partial(tuple.__new__, MessageRecord)


def _timestamp_ms(msg: confluent_kafka.Message) -> int:
    return msg.timestamp()[1]


class ConsumerBackend(ABC):
    """One Kafka consumer reading explicitly assigned partitions of one topic.

    ``poll`` raises :class:`TopicError` / :class:`OffsetRangeError` for errors that retrying cannot fix,
    and :class:`BrokerError` for transport trouble the caller may retry.
    """

    client: ClientName
    topic: str | None = None
    metadata: bool = False  # poll MessageRecords (with key, headers and timestamp) instead of RawRecords
    bounds_opens_client: bool = False  # offset_bounds opens a Kafka client of its own (callers count clients)

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

    def open(self) -> None:  # noqa: B027 - a hook: only a client that connects lazily overrides it
        """Connect now, where the client would otherwise wait for its first use."""

    @abstractmethod
    def close(self) -> None: ...

    @property
    def last_error(self) -> str | None:
        """The latest client-level error (e.g. a lost connection), for timeout messages."""
        return None

    @abstractmethod
    def offset_bounds(self, topic: str, probes: Mapping[int, int]) -> dict[int, tuple[int, int]]:
        """partition -> (earliest stored offset, exact log end) of each partition in ``probes``; the consumer holds
        no assignment afterwards.

        ``probes`` maps each partition to an offset expected to be at most its log end. Apache Kafka is asked with
        ListOffsets (the offsets do not matter); Tansu with a fetch at them, where the end of what the caller will
        read is cheapest: at the log end the broker answers with no records (after the consumer's fetch wait),
        anywhere else with everything from there on up to ``fetch.max.bytes``, whatever the partition's byte limit.

        Raises:
            TopicError: the topic or one of the partitions does not exist.
        """

    def __enter__(self) -> ConsumerBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reader_use(reader_cfg: ReaderConfig, fetch_wait_ms: int, tuning: dict[str, Any]) -> ConsumerUse:
    """The reader's consumer, either client. Both skip the records of aborted transactions and stop at the last
    stable offset: nothing a producer aborted is ever trained on. Their offsets, and those of the transaction
    markers, are the reader's counted gaps."""
    return ConsumerUse(
        purpose="reader",
        read_committed=True,
        fetch_wait_ms=fetch_wait_ms,
        fetch_max_bytes=reader_cfg.fetch_max_bytes,
        partition_fetch_bytes=reader_cfg.fetch_max_bytes,
        tuning=tuning,
    )


class ConfluentConsumer(ConsumerBackend):
    client: ClientName = "confluent"

    def __init__(self, kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig, metadata: bool = False) -> None:
        self.kafka_cfg, self.metadata = kafka_cfg, metadata
        self._last_error: str | None = None
        self._starts: dict[int, int] = {}  # the current assignment's start offsets
        # The reader knows where its ranges end; a long poll at the log end would only delay the next assign by up
        # to 500 ms (measured: 0.5 s per re-seek with the default, ~15 ms with 10 ms).
        use = _reader_use(
            reader_cfg,
            LOG_END_WAIT_MS,
            {
                # Once the prefetch queue reaches its bounds librdkafka pauses fetching for this long (default 1 s)
                # even after the queue drains: measured one 1 s stall per 20k records, 28k instead of 500k records/s.
                "fetch.queue.backoff.ms": QUEUE_FULL_BACKOFF_MS,
                # Bound librdkafka's prefetch queue so memory stays flat however large the topic is.
                "queued.max.messages.kbytes": max(1, 2 * reader_cfg.fetch_max_bytes // 1024),
                "queued.min.messages": max(1000, 4 * reader_cfg.max_poll_records),
                "error_cb": self._on_error,
            },
        )
        self._consumer = open_consumer(kafka_cfg, use)

    def _on_error(self, err: Any) -> None:
        # Transport errors arrive here, not from consume(); keep the latest for the caller's timeout message.
        self._last_error = str(err)
        log.debug("confluent client error: %s", err)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def assign(self, topic: str, starts: dict[int, int]) -> None:
        self.topic = topic
        self._starts = dict(starts)
        self._consumer.assign([confluent_kafka.TopicPartition(topic, p, o) for p, o in starts.items()])

    def poll(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        messages = self._consumer.consume(num_messages=max_records, timeout=timeout_s)
        errors = list(map(confluent_kafka.Message.error, messages))
        # identity, not ==: KafkaError's == against None leaves a TypeError pending (a SystemError later)
        if all(map(operator.is_, errors, itertools.repeat(None))):
            # The usual poll, built without a Python loop per message: that per-message work was the largest
            # share of the fetch on the rank's interpreter lock (docs/data_plane_benchmark.md, issue 23).
            columns = (
                map(confluent_kafka.Message.partition, messages),
                map(confluent_kafka.Message.offset, messages),
                map(confluent_kafka.Message.value, messages),
            )
            if not self.metadata:
                return list(map(_AS_RAW_RECORD, zip(*columns)))
            metadata = (
                map(confluent_kafka.Message.key, messages),
                map(confluent_kafka.Message.headers, messages),
                map(_timestamp_ms, messages),
            )
            return list(map(_AS_MESSAGE_RECORD, zip(*columns, *metadata)))
        return self._with_errors(messages, errors)

    def _record(self, msg: confluent_kafka.Message) -> RawRecord | MessageRecord:
        if self.metadata:
            return MessageRecord(
                msg.partition(), msg.offset(), msg.value(), msg.key(), msg.headers(), _timestamp_ms(msg)
            )
        return RawRecord(msg.partition(), msg.offset(), msg.value())

    def _with_errors(
        self, messages: list[confluent_kafka.Message], errors: list[confluent_kafka.KafkaError | None]
    ) -> list[RawRecord]:
        out: list[RawRecord] = []
        for msg, err in zip(messages, errors):
            if err is None:
                out.append(self._record(msg))
                continue
            code, where = err.code(), {"topic": msg.topic() or self.topic, "partition": msg.partition()}
            if code == confluent_kafka.KafkaError._PARTITION_EOF:
                continue
            if code in OUT_OF_RANGE:
                if self._stale(msg.partition(), msg.offset()):
                    log.debug(
                        "dropped a stale out-of-range error: %s (partition %s, offset %s)",
                        err.str(),
                        msg.partition(),
                        msg.offset(),
                    )
                    continue
                raise OffsetRangeError(f"offset out of range: {err.str()}", offset=msg.offset(), **where)
            if code in UNKNOWN_PARTITION:
                raise OffsetRangeError(f"unknown topic or partition: {err.str()}", **where)
            # Anything else (transport, leadership, timeouts) may heal: the reader retries until its deadline.
            raise BrokerError(f"consumer error on topic {where['topic']!r} partition {where['partition']}: {err.str()}")
        return out

    def position(self, partition: int) -> int | None:
        (tp,) = self._consumer.position([confluent_kafka.TopicPartition(self.topic, partition)])
        return tp.offset if tp.offset >= 0 else None  # librdkafka's OFFSET_INVALID is negative

    def _stale(self, partition: int, offset: int) -> bool:
        """An out-of-range error that is not about this consumer's current fetch: librdkafka 2.16 delivers the
        out-of-range answer to a bounds probe past the log end (Apache Kafka; Tansu answers with the bounds) even
        after the probe was unassigned, when cached watermarks had already answered the probe."""
        if partition not in self._starts:
            return True
        current = self.position(partition)
        return offset != (current if current is not None else self._starts[partition])

    def offset_bounds(
        self, topic: str, probes: Mapping[int, int], meanwhile: Callable[[], object] | None = None
    ) -> dict[int, tuple[int, int]]:
        """See :func:`kbit_core.kafka.offsets.offset_bounds` (``meanwhile`` overlaps its round trips)."""
        self.topic = topic
        self._starts = {}  # the check leaves no assignment behind
        return offset_bounds(self._consumer, self.kafka_cfg, topic, probes, meanwhile, lambda: self.last_error)

    def close(self) -> None:
        self._consumer.close()


class KafkaPythonConsumer(ConsumerBackend):
    client: ClientName = "kafka-python"
    bounds_opens_client = True

    def __init__(self, kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig, metadata: bool = False) -> None:
        self.kafka_cfg, self.reader_cfg, self.metadata = kafka_cfg, reader_cfg, metadata
        try:
            import crc32c  # noqa: F401  (kafka-python checks CRCs in pure Python without it: 10x slower)
        except ImportError:
            log.warning("the crc32c package is missing: kafka-python will verify CRCs very slowly")
        use = _reader_use(reader_cfg, FETCH_WAIT_MS, {"max_poll_records": reader_cfg.max_poll_records})
        self._opts = consumer_options(kafka_cfg, use, "kafka-python")
        self._kafka_consumer: Any = None

    def open(self) -> None:
        # Made here, not in __init__: kafka-python bootstraps (connection, ApiVersions, metadata: ~3 ms on loopback)
        # before its constructor returns, which offset_bounds overlaps with its confluent probe's round trips.
        if self._kafka_consumer is None:
            self._kafka_consumer = kafka.KafkaConsumer(**self._opts)

    @property
    def _consumer(self) -> Any:
        self.open()
        return self._kafka_consumer

    def assign(self, topic: str, starts: dict[int, int]) -> None:
        self.topic = topic
        tps = {p: kafka.TopicPartition(topic, p) for p in starts}
        self._consumer.assign(list(tps.values()))
        for p, offset in starts.items():
            self._consumer.seek(tps[p], offset)

    def poll(self, max_records: int, timeout_s: float) -> list[RawRecord]:
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except kafka.errors.OffsetOutOfRangeError as exc:
            tp_offsets = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
            tp, offset = next(iter(tp_offsets.items()), (None, None))
            raise OffsetRangeError(
                f"offset out of range: {exc}", topic=self.topic, partition=getattr(tp, "partition", None), offset=offset
            ) from None
        except kafka.errors.UnknownTopicOrPartitionError as exc:
            raise OffsetRangeError(f"unknown topic or partition: {exc}", topic=self.topic) from None
        except kafka.errors.KafkaError as exc:  # transport and leadership trouble: the reader retries until its end
            raise BrokerError(f"consumer error on topic {self.topic!r}: {exc}") from None
        if self.metadata:
            return [
                MessageRecord(r.partition, r.offset, r.value, r.key, r.headers, r.timestamp)
                for recs in batches.values()
                for r in recs
            ]
        return [RawRecord(r.partition, r.offset, r.value) for recs in batches.values() for r in recs]

    def position(self, partition: int) -> int | None:
        return self._consumer.position(kafka.TopicPartition(self.topic, partition), timeout_ms=0)

    def offset_bounds(self, topic: str, probes: Mapping[int, int]) -> dict[int, tuple[int, int]]:
        """Asked through a short-lived confluent consumer: kafka-python keeps no log start offset from a Fetch
        response, and decodes in Python every record of the probe's batch before the probed one (measured 15-27 ms
        a probe against 3-4 ms)."""
        with ConfluentConsumer(self.kafka_cfg, self.reader_cfg) as probe:
            return probe.offset_bounds(topic, probes, meanwhile=self.open)

    def close(self) -> None:
        if self._kafka_consumer is not None:
            self._kafka_consumer.close(autocommit=False)


_BACKENDS: dict[str, type[ConsumerBackend]] = {"confluent": ConfluentConsumer, "kafka-python": KafkaPythonConsumer}


def make_consumer(
    kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig, client: ClientName | None = None, *, metadata: bool = False
) -> ConsumerBackend:
    """A consumer for ``client`` (default ``kafka_cfg.client``) configured from the typed config; with ``metadata``
    it polls MessageRecords (key, headers, timestamp too)."""
    name = client or kafka_cfg.client
    if name not in _BACKENDS:
        raise ConfigError(f"unknown Kafka client {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name](kafka_cfg, reader_cfg, metadata)

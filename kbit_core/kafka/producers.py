"""Kafka producer clients behind one interface: confluent-kafka and kafka-python, each reporting every delivery
(partition, offset) so the caller knows exactly where each message went, and the ledger those reports fill.

Correctness never depends on ListOffsets(LATEST) (wrong on Tansu): offsets come from the delivery reports.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import crc32c  # noqa: F401  # kafka-python checksums in pure Python without it, 10x slower
import kafka
import kafka.errors
from confluent_kafka import KafkaError, KafkaException, Producer
from kafka.metrics.stats import Total

from kbit_core.config import ClientName, Compression, KafkaConfig, ProduceConfig
from kbit_core.errors import BrokerError, ConfigError, TopicError
from kbit_core.kafka import admin, replicas
from kbit_core.kafka.clients import LIBRDKAFKA_MAX_MESSAGE_BYTES, client_options
from kbit_core.kafka.manifest import PartitionManifest, digest_hex, record_digest
from kbit_core.kafka.settings import kafka_python_options

log = logging.getLogger(__name__)

# Producer-side buffer; a full buffer makes send() wait for deliveries instead of growing memory.
BUFFER_BYTES = 64 * 1024 * 1024
# librdkafka emits statistics (with the compressed batch sizes) this often.
STATS_INTERVAL_MS = 200
# flush() waits in slices this long, checking in between whether the broker is lost.
FLUSH_SLICE_S = 0.5
# kafka-python's default max_request_size (librdkafka's message.max.bytes: clients.LIBRDKAFKA_MAX_MESSAGE_BYTES)
KAFKA_PYTHON_MAX_REQUEST_SIZE = 1_048_576

# (partition, offset, error or None): how a backend reports one delivered (or failed) message.
DeliveryCallback = Callable[[int, int, "str | None"], None]


def delivery_timeout_ms(kcfg: KafkaConfig) -> int:
    """How long a message may wait for its acknowledgement before delivery counts as failed."""
    return int(kcfg.request_timeout_s * 4 * 1000)


class ProducerBackend(ABC):
    """The small surface kbit needs from a Kafka producer: acks=all, idempotent, explicit partition."""

    name: ClassVar[ClientName]
    # Give up producing once every broker connection has been down this long, naming the broker and why, instead
    # of freezing for the delivery timeout (4 x request_timeout_s); None waits it out (the live producer rides out
    # broker restarts). Only the confluent client reports its connections; kafka-python always waits.
    broker_lost_s: float | None = None

    @abstractmethod
    def send(self, topic: str, partition: int, key: bytes, value: bytes, on_delivery: DeliveryCallback) -> None:
        """Queue one message; waits (serving deliveries) while the local buffer is full."""

    @abstractmethod
    def flush(self, timeout_s: float, *, count_wire_bytes: bool = True) -> None:
        """Wait until every queued message is delivered or failed; BrokerError on timeout.

        ``count_wire_bytes=False`` skips waiting for the client's statistics (the live producer flushes every
        few records and needs no byte count)."""

    @abstractmethod
    def wire_bytes(self) -> int | None:
        """Compressed record-batch bytes sent so far (after flush), or None when the client cannot tell."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def max_message_bytes(self) -> int:
        """The largest message (uncompressed) this client sends."""


class ConfluentProducer(ProducerBackend):
    """confluent-kafka's producer. Delivery reports are only queued inside librdkafka's callbacks and handed to
    the caller's callbacks once the client call returned: after a fatal error (an idempotent producer whose
    broker restarted empty is answered UNKNOWN_PRODUCER_ID) confluent-kafka calls the next delivery callback with
    that error still raised, and a lock taken there would stay locked, hanging the callback after it."""

    name = "confluent"

    def __init__(self, kcfg: KafkaConfig, pcfg: ProduceConfig, compression: Compression) -> None:
        self._batch_bytes = 0
        self._stats_seen = 0
        self._stats_cover_all = False
        self._reports: list[tuple[DeliveryCallback, int, Any, int]] = []
        self._max_message_bytes = int(kcfg.client_extra().get("message.max.bytes", LIBRDKAFKA_MAX_MESSAGE_BYTES))
        self._kcfg = kcfg
        self._down_since: float | None = None  # when librdkafka reported every broker down; None while one is up
        self._transport_error: str | None = None
        self._producer = Producer(
            {
                **client_options(kcfg),
                "acks": "all",
                "enable.idempotence": True,
                "compression.type": compression,
                "linger.ms": pcfg.linger_ms,
                "batch.size": pcfg.batch_size_bytes,
                "queue.buffering.max.kbytes": BUFFER_BYTES // 1024,
                "message.timeout.ms": delivery_timeout_ms(kcfg),
                "statistics.interval.ms": STATS_INTERVAL_MS,
                "stats_cb": self._on_stats,
                "error_cb": self._on_error,
            }
        )

    def _on_stats(self, payload: str) -> None:
        # topics.<t>.batchsize is a window reset at every emission, so the windows add up to the total.
        stats = json.loads(payload)
        self._batch_bytes += sum(t.get("batchsize", {}).get("sum", 0) for t in stats.get("topics", {}).values())
        if any(b.get("state") == "UP" for b in stats.get("brokers", {}).values()):
            self._down_since = None
        self._stats_seen += 1

    def _on_error(self, err: KafkaError) -> None:
        # Connection trouble arrives here, not with the deliveries, which librdkafka retries until they time out.
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._down_since = self._down_since or time.monotonic()
        elif err.code() in (KafkaError._TRANSPORT, KafkaError._RESOLVE):
            self._transport_error = err.str()
        log.debug("confluent producer error: %s", err)

    def _check_broker(self) -> None:
        """BrokerError naming the broker and the connection error once every broker was down for broker_lost_s."""
        if self.broker_lost_s is None or self._down_since is None:
            return
        down_s = time.monotonic() - self._down_since
        if down_s >= self.broker_lost_s:
            raise admin.unreachable(
                self._kcfg, f"lost while producing, down for {down_s:.0f} s ({self._transport_error or 'no answer'})"
            )

    def _serve(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the client, then the delivery reports it served. A client error becomes a
        BrokerError, also one raised under the SystemError of a callback that ran after it."""
        try:
            return call(*args)
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, KafkaException):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            error = cause.args[0]
            raise BrokerError(
                ("fatal producer error (only a new producer can go on): " if error.fatal() else "") + error.str()
            ) from None
        finally:
            if self._reports:  # most calls serve none
                reports = self._reports[:]
                self._reports.clear()
                for on_delivery, partition, err, offset in reports:
                    on_delivery(partition, offset, None if err is None else err.str())

    def send(self, topic: str, partition: int, key: bytes, value: bytes, on_delivery: DeliveryCallback) -> None:
        reports = self._reports  # not self: librdkafka holds the callback where the garbage collector cannot see it

        def report(err: Any, msg: Any) -> None:  # the message (a copy of its value) is not kept
            reports.append((on_delivery, partition, err, msg.offset() if err is None else -1))

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, partition=partition, on_delivery=report)
                break
            except BufferError:
                self._serve(self._producer.poll, 0.05)
                self._check_broker()
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError._FATAL:
                    self._serve(self._producer.poll, 0)  # raises the fatal error itself, by name
                raise BrokerError(
                    f"cannot produce a {len(value)}-byte message to {topic}[{partition}]: {exc.args[0].str()}"
                ) from None
        self._serve(self._producer.poll, 0)
        self._check_broker()

    def flush(self, timeout_s: float, *, count_wire_bytes: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        left = self._serve(self._producer.flush, min(timeout_s, FLUSH_SLICE_S))
        while left and time.monotonic() < deadline:
            self._check_broker()
            left = self._serve(self._producer.flush, min(deadline - time.monotonic(), FLUSH_SLICE_S))
        if left:
            raise BrokerError(f"{left} message(s) still undelivered after {timeout_s:.0f}s")
        if not count_wire_bytes:
            return
        # one more statistics emission after the last batch went out, so wire_bytes covers it
        seen, deadline = self._stats_seen, time.monotonic() + 5 * STATS_INTERVAL_MS / 1000
        while self._stats_seen == seen and time.monotonic() < deadline:
            self._serve(self._producer.poll, STATS_INTERVAL_MS / 1000)
        self._stats_cover_all = self._stats_seen > seen

    def wire_bytes(self) -> int | None:
        return self._batch_bytes if self._stats_cover_all else None

    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    def close(self) -> None:
        # After a failure, drop what is still queued instead of waiting out the delivery timeout; closing goes on
        # after an error (a fatal one may surface only now).
        for call in (self._producer.purge, self._producer.close):
            try:
                self._serve(call)
            except BrokerError as exc:
                log.info("closing the producer: %s", exc)


class _SenderAnswers(logging.Handler):
    """The last trouble kafka-python's sender logged, per sender: it retries a refused batch until the delivery
    deadline and only logs why, so a flush that times out would otherwise not say what the broker answered."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.args and isinstance(record.args, tuple):
            sender = str(record.args[0])
            self.last[sender] = record.getMessage().removeprefix(f"{sender}: ")


_SENDER_ANSWERS = _SenderAnswers()
logging.getLogger("kafka.producer.sender").addHandler(_SENDER_ANSWERS)


class KafkaPythonProducer(ProducerBackend):
    name = "kafka-python"

    def __init__(self, kcfg: KafkaConfig, pcfg: ProduceConfig, compression: Compression) -> None:
        timeout_ms = delivery_timeout_ms(kcfg)
        connection = kafka_python_options(kcfg)
        self._producer = kafka.KafkaProducer(
            **connection,
            acks="all",
            enable_idempotence=True,
            compression_type=None if compression == "none" else compression,
            linger_ms=pcfg.linger_ms,
            batch_size=pcfg.batch_size_bytes,
            delivery_timeout_ms=max(timeout_ms, pcfg.linger_ms + connection["request_timeout_ms"]),
            max_block_ms=timeout_ms,
        )
        # The 'batch-size' sensor sees every compressed batch but only exposes avg/max; add a running total.
        self._batch_total = self._producer._metrics.metric_name("batch-size-total", "producer-metrics")
        self._producer._metrics.sensor("batch-size").add(self._batch_total, Total())
        # kafka-python 3 has no buffer_memory bound, so kbit bounds the unacknowledged bytes itself
        self._pending_bytes = 0
        self._pending = threading.Condition()
        self._max_block_s = timeout_ms / 1000

    def send(self, topic: str, partition: int, key: bytes, value: bytes, on_delivery: DeliveryCallback) -> None:
        size = len(value)
        with self._pending:
            if not self._pending.wait_for(lambda: self._pending_bytes < BUFFER_BYTES, timeout=self._max_block_s):
                raise BrokerError(
                    f"no acknowledgement from {topic} for {self._max_block_s:.0f}s "
                    f"({self._pending_bytes} bytes waiting)"
                )
            self._pending_bytes += size

        def settled(offset: int, error: str | None) -> None:
            with self._pending:
                self._pending_bytes -= size
                self._pending.notify()
            on_delivery(partition, offset, error)

        try:
            future = self._producer.send(topic, value=value, key=key, partition=partition)
        except (kafka.errors.KafkaError, ValueError) as exc:  # ValueError: partition not in the topic's metadata
            raise BrokerError(f"cannot produce a {size}-byte message to {topic}[{partition}]: {exc}") from None
        future.add_callback(lambda md: settled(md.offset, None))
        future.add_errback(lambda exc: settled(-1, str(exc) or type(exc).__name__))

    def flush(self, timeout_s: float, *, count_wire_bytes: bool = True) -> None:
        try:
            self._producer.flush(timeout=timeout_s)
        except kafka.errors.KafkaTimeoutError:
            answer = _SENDER_ANSWERS.last.pop(str(self._producer._sender), None)
            why = f"; the last answer: {answer}" if answer else ""
            raise BrokerError(f"messages still undelivered after {timeout_s:.0f}s{why}") from None

    def wire_bytes(self) -> int | None:
        metric = self._producer._metrics.metrics.get(self._batch_total)
        return int(metric.value()) if metric is not None else None

    def close(self) -> None:
        _SENDER_ANSWERS.last.pop(str(self._producer._sender), None)  # a long-lived process makes many producers
        # After a failure the batches still queued cannot be delivered: closing drops them instead of raising.
        try:
            self._producer.close(timeout=5)
        except kafka.errors.KafkaTimeoutError as exc:
            log.info("closing the producer: %s", exc)

    def max_message_bytes(self) -> int:
        return KAFKA_PYTHON_MAX_REQUEST_SIZE


BACKENDS: dict[str, type[ProducerBackend]] = {b.name: b for b in (ConfluentProducer, KafkaPythonProducer)}


def make_producer(
    kcfg: KafkaConfig,
    pcfg: ProduceConfig,
    compression: Compression,
    client: str | None = None,
    broker_lost_s: float | None = None,
) -> ProducerBackend:
    name = client or pcfg.client
    if name not in BACKENDS:
        raise ConfigError(f"unknown producer client {name!r}; choose one of {sorted(BACKENDS)}")
    backend = BACKENDS[name](kcfg, pcfg, compression)
    backend.broker_lost_s = broker_lost_s
    return backend


@dataclass
class _PartitionTally:
    first: int | None = None
    last: int = -1
    messages: int = 0
    records: int = 0
    value_bytes: int = 0
    digest: int | None = 0  # None once a message came without its digest


class DeliveryLedger:
    """Accumulates delivery reports (possibly from a client thread) into exact per-partition offsets. With the
    cluster's ``kcfg``, a failed delivery's error also names a partition whose in-sync replicas are too few."""

    def __init__(self, topic: str, partitions: int, kcfg: KafkaConfig | None = None) -> None:
        self.topic = topic
        self._kcfg = kcfg
        self._tallies = [_PartitionTally() for _ in range(partitions)]
        self._errors: dict[int, list[str]] = {}
        self._lock = threading.Lock()
        self.delivered_records = 0

    def callback(self, num_records: int, value_bytes: int, digest: bytes | None = None) -> DeliveryCallback:
        """The delivery callback for one message of ``num_records`` records and ``value_bytes`` bytes whose
        :func:`message_digest` is ``digest`` (without one, its partition gets no content digest)."""
        return partial(self._settle, num_records, value_bytes, digest)

    def _settle(
        self, num_records: int, value_bytes: int, digest: bytes | None, partition: int, offset: int, error: str | None
    ) -> None:
        with self._lock:
            if error is not None:
                self._errors.setdefault(partition, []).append(error)
                return
            t = self._tallies[partition]
            t.first = offset if t.first is None else min(t.first, offset)
            t.last = max(t.last, offset)
            t.messages += 1
            t.records += num_records
            t.value_bytes += value_bytes
            t.digest = None if digest is None or t.digest is None else t.digest + record_digest(offset, digest)
            self.delivered_records += num_records

    def raise_errors(self) -> None:
        """BrokerError, one line, naming the topic, each failed partition, its first error and, when the cluster
        says so, NOT_ENOUGH_REPLICAS with the partition's in-sync replicas."""
        with self._lock:
            if not self._errors:
                return
            errors = {p: (len(errs), errs[0]) for p, errs in sorted(self._errors.items())}
        reasons = replicas.not_enough_replicas(self._kcfg, self.topic, errors) if self._kcfg else {}
        parts = [
            f"{self.topic}[{p}]: {count} message(s) failed: {reasons[p]} (the client's error: {first})"
            if p in reasons
            else f"{self.topic}[{p}]: {count} message(s) failed, first error: {first}"
            for p, (count, first) in errors.items()
        ]
        raise BrokerError("delivery failed: " + "; ".join(parts))

    def partitions(self) -> list[PartitionManifest]:
        self.raise_errors()
        out = []
        for p, t in enumerate(self._tallies):
            first = t.first if t.first is not None else 0
            if t.messages and t.last - first + 1 != t.messages:
                raise TopicError(
                    f"{self.topic}[{p}]: {t.messages} messages landed at offsets {first}..{t.last}, "
                    f"which are not contiguous; did another producer write to the topic?"
                )
            out.append(
                PartitionManifest(
                    partition=p,
                    first_offset=first,
                    last_offset=first + t.messages - 1,
                    num_messages=t.messages,
                    num_records=t.records,
                    value_bytes=t.value_bytes,
                    content_digest=None if t.digest is None else digest_hex(t.digest),
                )
            )
        return out

"""Every Kafka consumer kbit opens, built in one place from the typed Kafka config and what the consumer is for.

kbit's consumers all assign their partitions themselves: none joins its group or commits, so each gets a group id
of its own (librdkafka requires one; concurrent readers never rebalance each other) unless its use names one. What differs between them (offset reset, isolation,
fetch waits and sizes, end-of-partition events, the client's own tuning) is a :class:`ConsumerUse`;
:func:`open_consumer` turns the config and a use into a confluent-kafka or kafka-python consumer. The reader's
client-neutral interface over either is :class:`kbit_core.kafka.consumers.ConsumerBackend`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Both clients name their types alike: used qualified by client.
import confluent_kafka
import kafka

from kbit_core.config import ClientName, KafkaConfig
from kbit_core.errors import ConfigError
from kbit_core.kafka.settings import confluent_options, kafka_python_options, mask

log = logging.getLogger(__name__)

# librdkafka's sparse connections open a broker connection only when a request needs one, and the first
# request of a new client then waited ~52 ms in a third of the attempts (measured: 8 of 24 metadata calls on
# loopback; 0 of 24 with eager connections). Short-lived clients that need the broker at once connect eagerly.
EAGER_CONNECT = {"enable.sparse.connections": False}
READ_COMMITTED = "read_committed"


class _DemotedLog(logging.LoggerAdapter):
    """librdkafka logs every refused connection as an error; kbit raises its own clear error instead."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.debug(msg, *args, **kwargs)


_rdkafka_log = _DemotedLog(logging.getLogger("kbit_core.kafka.librdkafka"), {})


def client_options(kcfg: KafkaConfig) -> dict[str, Any]:
    """confluent connection options with librdkafka's own logging routed to Python logging at DEBUG."""
    return {**confluent_options(kcfg), "logger": _rdkafka_log}


@dataclass(frozen=True)
class ConsumerUse:
    """What one consumer is for: the options that differ between kbit's consumers.

    Attributes:
        purpose: Names the consumer's fresh group id (``kbit-<purpose>-<random>``), or kafka-python's client id.
        group: A fixed group id instead (never joined either).
        reset_is_error: An offset outside the log is an error, never moved silently (False: the client's default).
        read_committed: Skip aborted transactions' records and stop at the last stable offset.
        fetch_wait_ms: How long the broker may hold a fetch for data (None: the client's default).
        fetch_max_bytes: Bounds one fetch response and, on confluent, its prefetch queue (None: the default).
        partition_fetch_bytes: Bounds one partition's share of a fetch (None: the default).
        partition_eof: confluent only: report reaching a partition's end as an event.
        tuning: The client's own further options, by its own names (queue bounds, callbacks, poll sizes).
    """

    purpose: str
    group: str | None = None
    reset_is_error: bool = True
    read_committed: bool = False
    fetch_wait_ms: int | None = None
    fetch_max_bytes: int | None = None
    partition_fetch_bytes: int | None = None
    partition_eof: bool = False
    tuning: Mapping[str, Any] = field(default_factory=dict)

    def group_id(self) -> str:
        return self.group or f"kbit-{self.purpose}-{uuid.uuid4().hex[:12]}"


def open_consumer(kcfg: KafkaConfig, use: ConsumerUse, client: ClientName = "confluent") -> Any:
    """A ``confluent_kafka.Consumer`` or ``kafka.KafkaConsumer`` (``client``) for ``use``, connected per ``kcfg``."""
    opts = consumer_options(kcfg, use, client)
    return confluent_kafka.Consumer(opts) if client == "confluent" else kafka.KafkaConsumer(**opts)


def consumer_options(kcfg: KafkaConfig, use: ConsumerUse, client: ClientName) -> dict[str, Any]:
    """What :func:`open_consumer` hands ``client``; for a consumer that connects later (kafka-python bootstraps in
    its constructor), so that bad security settings still fail where it is made."""
    if client not in _CLIENT_OPTIONS:
        raise ConfigError(f"unknown Kafka client {client!r}; choose one of {sorted(_CLIENT_OPTIONS)}")
    opts = {**_CLIENT_OPTIONS[client](kcfg, use), **_chosen(use, client), **use.tuning}
    if client == "confluent":
        _fit_request_limit(opts)
    log.debug("%s consumer (%s) options: %s", client, use.purpose, mask(_plain(opts)))
    return opts


LIBRDKAFKA_MAX_MESSAGE_BYTES = 1_000_000  # librdkafka's default message.max.bytes
LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES = 1_000  # the least it accepts


def _fit_request_limit(opts: dict[str, Any]) -> None:
    """librdkafka refuses a ``fetch.max.bytes`` below its ``message.max.bytes``, which bounds the requests it sends
    (a consumer's are a few hundred bytes): a consumer asked for smaller fetches (``reader.fetch_max_bytes``) gets
    that bound lowered with them; one set in ``kafka.extra`` above the fetch is a ConfigError naming both."""
    fetch, bound = opts.get("fetch.max.bytes"), opts.get("message.max.bytes")
    if fetch is None or fetch >= (bound or LIBRDKAFKA_MAX_MESSAGE_BYTES):
        return
    if bound is not None:
        raise ConfigError(
            f"a consumer's fetch.max.bytes={fetch} (reader.fetch_max_bytes) is below kafka.extra's "
            f"message.max.bytes={bound}, which librdkafka refuses: raise the one or lower the other"
        )
    opts["message.max.bytes"] = max(LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES, fetch)


def _confluent(kcfg: KafkaConfig, use: ConsumerUse) -> dict[str, Any]:
    return {
        **client_options(kcfg),
        **EAGER_CONNECT,
        "group.id": use.group_id(),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": use.partition_eof,
    }


def _kafka_python(kcfg: KafkaConfig, use: ConsumerUse) -> dict[str, Any]:
    return {
        **kafka_python_options(kcfg),
        "group_id": None,  # kafka-python needs none for assigned partitions
        "client_id": use.group_id(),
        "enable_auto_commit": False,
        # kbit reads none of kafka-python's sensors; creating them took 1.4 of its 3.2 ms start-up (measured)
        "metrics_enabled": False,
    }


_CLIENT_OPTIONS = {"confluent": _confluent, "kafka-python": _kafka_python}
# ConsumerUse's isolation, fetch wait and sizes, and offset reset, by each client's option names
_OPTION_NAMES = {
    "confluent": ("isolation.level", "fetch.wait.max.ms", "fetch.max.bytes", "max.partition.fetch.bytes"),
    "kafka-python": ("isolation_level", "fetch_max_wait_ms", "fetch_max_bytes", "max_partition_fetch_bytes"),
}
_RESET = {"confluent": ("auto.offset.reset", "error"), "kafka-python": ("auto_offset_reset", "none")}


def _chosen(use: ConsumerUse, client: ClientName) -> dict[str, Any]:
    """The settings ``use`` chose, in ``client``'s names; those it left unset keep the client's default (kafka-python's
    isolation default is read_uncommitted, librdkafka's read_committed)."""
    isolation = READ_COMMITTED if use.read_committed else None
    values = (isolation, use.fetch_wait_ms, use.fetch_max_bytes, use.partition_fetch_bytes)
    chosen = dict(zip(_OPTION_NAMES[client], values))
    if use.reset_is_error:
        name, value = _RESET[client]
        chosen[name] = value
    return {name: value for name, value in chosen.items() if value is not None}


def _plain(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The options without callbacks and loggers, for the debug log."""
    return {k: v for k, v in opts.items() if not callable(v) and not isinstance(v, logging.LoggerAdapter)}

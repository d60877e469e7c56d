"""Topic administration over confluent_kafka.admin: metadata, topics and their configuration, and ListOffsets.

Exact log bounds are :mod:`kbit_core.kafka.offsets`' (it chooses per broker); Tansu's workaround for its short
ListOffsets(LATEST) is :mod:`kbit_core.kafka.tansu`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from kbit_core.brokers.broker import port_open
from kbit_core.brokers.local import died_here
from kbit_core.config import KafkaConfig
from kbit_core.errors import BrokerError, TopicError
from kbit_core.kafka.clients import client_options

log = logging.getLogger(__name__)

# Bound for metadata round trips: a broker that is down must fail fast, not after request_timeout_s.
METADATA_TIMEOUT_S = 5.0
# Topic deletion is asynchronous on real clusters; wait this long for the name to disappear.
DELETE_WAIT_S = 15.0
LEADER_ELECTION_S = 30.0  # how long a replicated cluster is given to elect a dead leader's successor
AUTHORIZATION_FAILED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED})
CLEANUP_POLICY = "cleanup.policy"
# CreateTopics refusals that a restarting broker or a changing controller causes and that pass once it is back: too
# few brokers registered for the replication factor, and Kafka's unknown error (seen during a rolling upgrade)
CREATE_RETRIABLE = frozenset(
    {
        KafkaError.INVALID_REPLICATION_FACTOR,
        KafkaError.UNKNOWN,
        KafkaError.NOT_CONTROLLER,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)
OUT_OF_RANGE = frozenset({KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET})
UNKNOWN_PARTITION = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC}
)


def describe_broker(kcfg: KafkaConfig) -> str:
    """'embedded broker host:port' or 'Kafka at host:port', for error messages."""
    kind = "embedded broker" if kcfg.uses_embedded else "Kafka cluster at"
    return f"{kind} {kcfg.resolved_bootstrap()}"


def unreachable(kcfg: KafkaConfig, detail: str) -> BrokerError:
    died = died_here(kcfg) if kcfg.uses_embedded else None
    if died is not None:
        return BrokerError(f"{died}: {detail}")
    hint = " (start it with `kbit stack up`)" if kcfg.uses_embedded else ""
    return BrokerError(f"cannot reach the {describe_broker(kcfg)}{hint}: {detail}")


def require_embedded_listening(kcfg: KafkaConfig) -> None:
    """Fail at once, instead of after a metadata timeout, when the embedded broker is not running."""
    if kcfg.uses_embedded and not port_open(kcfg.embedded.host, kcfg.embedded.port):
        raise unreachable(kcfg, "nothing listens there")


def _admin(kcfg: KafkaConfig) -> AdminClient:
    require_embedded_listening(kcfg)
    return AdminClient(client_options(kcfg))


def _metadata(client: AdminClient | Consumer, kcfg: KafkaConfig, topic: str | None = None):
    try:
        return client.list_topics(topic, timeout=min(METADATA_TIMEOUT_S, kcfg.request_timeout_s))
    except KafkaException as exc:
        raise unreachable(kcfg, exc.args[0].str()) from None


def list_topics(kcfg: KafkaConfig) -> list[str]:
    """Names of the topics on the broker (internal '__' topics excluded), sorted."""
    return sorted(t for t in _metadata(_admin(kcfg), kcfg).topics if not t.startswith("__"))


def topic_exists(kcfg: KafkaConfig, topic: str) -> bool:
    return topic in _metadata(_admin(kcfg), kcfg).topics


def wait_for_topic(kcfg: KafkaConfig, topic: str, timeout_s: float, what: str, advice: str) -> None:
    """Return once ``topic`` exists (its producer may still be starting); TopicError after ``timeout_s`` naming it as
    ``what`` (``"stream topic"``) and what to do (``advice``)."""
    deadline = time.monotonic() + timeout_s
    while not topic_exists(kcfg, topic):
        if time.monotonic() > deadline:
            raise TopicError(
                f"{what} {topic!r} does not exist on the {describe_broker(kcfg)} after {timeout_s:.0f}s; {advice}"
            )
        time.sleep(0.5)


def topic_partitions(kcfg: KafkaConfig, topic: str) -> list[int]:
    """Sorted partition ids of ``topic``; TopicError naming it when it does not exist (or when this principal may
    not see it). Apache Kafka is asked for ``topic`` alone, so that it says which; Tansu's admin metadata request
    would create a topic it names."""
    return _partitions_in(_metadata(_admin(kcfg), kcfg, None if kcfg.tansu else topic), kcfg, topic)


def consumer_partitions(consumer: Consumer, kcfg: KafkaConfig, topic: str) -> list[int]:
    """:func:`topic_partitions` through an open consumer, asking for ``topic`` alone (a consumer's request never
    creates it; the admin client's would, on Tansu)."""
    return _partitions_in(_metadata(consumer, kcfg, topic), kcfg, topic)


def _partitions_in(cluster: Any, kcfg: KafkaConfig, topic: str) -> list[int]:
    meta = cluster.topics.get(topic)
    if meta is None or (meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise TopicError(f"topic {topic!r} does not exist on the {describe_broker(kcfg)}")
    if meta.error is not None and meta.error.code() in AUTHORIZATION_FAILED:
        raise not_authorized(kcfg, topic, "read")
    if meta.error is not None:
        raise TopicError(f"topic {topic!r}: {meta.error.str()}")
    return sorted(meta.partitions)


def not_authorized(kcfg: KafkaConfig, topic: str, operation: str) -> TopicError:
    """The one-line error for a principal that no ACL allows ``operation`` on ``topic``."""
    principal = f"User:{kcfg.sasl_username}" if kcfg.sasl_username else "this client's principal"
    return TopicError(
        f"{principal} is not authorized to {operation} topic {topic!r} on the {describe_broker(kcfg)}: "
        "no ACL allows it (TOPIC_AUTHORIZATION_FAILED); ask the cluster's administrator for one, or check "
        "kafka.sasl_username"
    )


def create_topic(kcfg: KafkaConfig, topic: str, partitions: int, replication_factor: int | None = None) -> None:
    """Create ``topic`` and wait until the broker's metadata lists all its partitions (Apache Kafka answers
    CreateTopics once the controller committed it, and its broker's metadata can follow a moment later); TopicError
    when it already exists (callers decide whether to delete it first). ``replication_factor`` defaults to
    kafka.topic_replication_factor."""
    admin = _admin(kcfg)
    _metadata(admin, kcfg)
    _create_retrying(admin, kcfg, topic, partitions, replication_factor or kcfg.topic_replication_factor)
    deadline = time.monotonic() + kcfg.request_timeout_s
    while len(getattr(_metadata(admin, kcfg).topics.get(topic), "partitions", None) or {}) < partitions:
        if time.monotonic() > deadline:
            raise TopicError(
                f"topic {topic!r} is not listed with its {partitions} partition(s) "
                f"{kcfg.request_timeout_s:g}s after its creation on the {describe_broker(kcfg)}"
            )
        time.sleep(0.05)
    log.info("created topic %s with %d partition(s)", topic, partitions)


def _create_retrying(admin: AdminClient, kcfg: KafkaConfig, topic: str, partitions: int, replicas: int) -> None:
    """CreateTopics, asked again on a retriable refusal (a broker of a replicated cluster restarting in a rolling
    restart or upgrade: too few brokers registered for the replication factor, or an unknown error from a controller
    changing) until ``kafka.request_timeout_s`` passed; then a TopicError naming the last refusal and the wait."""
    # delete, never compact, whatever the broker's default: compaction would take records out of a manifest
    new = NewTopic(topic, partitions, replicas, config={CLEANUP_POLICY: "delete"})
    deadline, refused = time.monotonic() + kcfg.request_timeout_s, None
    # whether a refused attempt may still have created the topic (its answer lost); too few brokers for the
    # replication factor is a definite no, so a topic found after only such refusals is someone else's
    answer_lost = False
    while True:
        future = admin.create_topics([new], operation_timeout=kcfg.request_timeout_s)[topic]
        try:
            future.result(timeout=kcfg.request_timeout_s)
            return
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
        except TimeoutError:
            err = KafkaError(KafkaError._TIMED_OUT)
        if err.code() == KafkaError._TIMED_OUT:
            # no answer at all (the brokers cut off or frozen), whether librdkafka's own wait for the controller
            # (operation_timeout) ended first or this one: the wait is over, there is nothing to ask again
            raise TopicError(
                f"cannot create topic {topic!r} ({partitions} partitions, replication factor {replicas}): the "
                f"{describe_broker(kcfg)} gave no answer within {kcfg.request_timeout_s:g}s (kafka.request_timeout_s)"
            )
        if err.code() == KafkaError.TOPIC_ALREADY_EXISTS and answer_lost:
            # an earlier attempt's answer was lost (a timeout, a controller changing) after the controller committed
            # it: the topic is this call's, as no one else creates it meanwhile (produces of a topic are exclusive)
            log.warning("topic %s exists after an attempt refused with %s: created by that attempt", topic, refused)
            return
        if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            raise TopicError(f"topic {topic!r} already exists on the {describe_broker(kcfg)}")
        if err.code() in AUTHORIZATION_FAILED:
            raise not_authorized(kcfg, topic, "create")
        retriable = err.retriable() or err.code() in CREATE_RETRIABLE
        if not retriable or time.monotonic() > deadline:
            waited = f" (asked again for {kcfg.request_timeout_s:g}s: kafka.request_timeout_s)" if refused else ""
            raise TopicError(
                f"cannot create topic {topic!r} ({partitions} partitions, replication factor {replicas}) on the "
                f"{describe_broker(kcfg)}: {err.name()}: {err.str()}{waited}"
            )
        if refused is None:
            log.warning("creating topic %s: %s: %s; asking again (a broker restarting?)", topic, err.name(), err.str())
        refused = err.name()
        answer_lost = answer_lost or err.code() != KafkaError.INVALID_REPLICATION_FACTOR
        time.sleep(0.5)


def topic_config(kcfg: KafkaConfig, topic: str) -> dict[str, str]:
    """The topic's effective configuration (its own settings over the broker's defaults), by name."""
    client = _admin(kcfg)  # held until the answer came: a collected client abandons its futures
    futures = client.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
    try:
        (entries,) = [f.result(timeout=kcfg.request_timeout_s) for f in futures.values()]
    except KafkaException as exc:
        raise TopicError(f"cannot describe the configuration of topic {topic!r}: {exc.args[0].str()}") from None
    return {name: entry.value for name, entry in entries.items()}


def refuse_compacted(kcfg: KafkaConfig, topic: str) -> None:
    """TopicError when ``topic`` is compacted: compaction removes every record but the last of each key (and
    tombstones), leaving holes in the offsets a manifest points at, so kbit trains on no compacted topic."""
    policy = topic_config(kcfg, topic).get(CLEANUP_POLICY) or "delete"
    if "compact" in policy.split(","):
        raise TopicError(
            f"topic {topic!r} has {CLEANUP_POLICY}={policy}: compaction removes records a manifest points at, so kbit "
            f"refuses it; set {CLEANUP_POLICY}=delete on it or produce into a new topic"
        )


def delete_topic(kcfg: KafkaConfig, topic: str) -> bool:
    """Delete ``topic`` and wait until the broker no longer lists it; False when it did not exist."""
    admin = _admin(kcfg)
    if topic not in _metadata(admin, kcfg).topics:
        return False
    future = admin.delete_topics([topic], operation_timeout=kcfg.request_timeout_s)[topic]
    try:
        future.result(timeout=kcfg.request_timeout_s)
    except KafkaException as exc:
        err: KafkaError = exc.args[0]
        if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return False
        raise TopicError(f"cannot delete topic {topic!r}: {err.str()}") from None
    deadline = time.monotonic() + DELETE_WAIT_S
    while topic in _metadata(admin, kcfg).topics:
        if time.monotonic() > deadline:
            raise TopicError(f"topic {topic!r} is still listed {DELETE_WAIT_S:.0f}s after its deletion")
        time.sleep(0.1)
    log.info("deleted topic %s", topic)
    return True


def max_message_bytes(kcfg: KafkaConfig, topic: str) -> int | None:
    """The largest record batch the broker accepts into ``topic``: the topic's max.message.bytes, or for a topic not
    created yet the brokers' message.max.bytes (their default); None when no broker says (Tansu)."""
    admin = _admin(kcfg)
    cluster = _metadata(admin, kcfg)
    if topic in cluster.topics:
        asked = [(ConfigResource(ResourceType.TOPIC, topic), "max.message.bytes")]
    else:
        # A broker's own setting is answered by that broker alone, and the first one listed may be down or cut off
        # while the others serve (on the bed a produce failed on this question's bare TimeoutError): ask the next.
        asked = [(ConfigResource(ResourceType.BROKER, str(b)), "message.max.bytes") for b in cluster.brokers]
    for resource, name in asked:
        try:
            entries = admin.describe_configs([resource], request_timeout=METADATA_TIMEOUT_S)[resource].result(
                timeout=METADATA_TIMEOUT_S
            )
            return int(entries[name].value)
        except (KafkaException, KeyError, ValueError, TypeError, TimeoutError) as exc:
            log.debug("%s of the %s does not tell its %s: %r", resource, describe_broker(kcfg), name, exc)
    return None


def require_partitions(topic: str, partitions: Iterable[int], present: list[int]) -> list[int]:
    """The sorted ``partitions``; TopicError naming those missing from ``present``."""
    wanted = sorted(set(partitions))
    missing = [p for p in wanted if p not in present]
    if missing:
        raise TopicError(f"topic {topic!r} has no partition(s) {missing} (it has {sorted(present)})")
    return wanted


def list_offsets(
    consumer: Consumer, kcfg: KafkaConfig, topic: str, partitions: Iterable[int]
) -> dict[int, tuple[int, int]]:
    """partition -> (ListOffsets(EARLIEST), ListOffsets(LATEST)); Tansu may answer the latter short."""
    timeout = min(METADATA_TIMEOUT_S, kcfg.request_timeout_s)
    deadline = time.monotonic() + LEADER_ELECTION_S
    while True:
        try:
            return {
                p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout, cached=False)
                for p in partitions
            }
        except KafkaException as exc:
            # A replicated cluster moves a dead broker's partitions to a new leader within its broker session
            # timeout: ask again meanwhile. A single broker has no one to take over, so its failure is final.
            if time.monotonic() > deadline or not _several_brokers(consumer, timeout):
                raise unreachable(kcfg, f"listing offsets of {topic}: {exc.args[0].str()}") from None


def _several_brokers(consumer: Consumer, timeout: float) -> bool:
    """Whether the cluster's metadata lists more than one broker (False when none answers)."""
    try:
        return len(consumer.list_topics(timeout=timeout).brokers) > 1
    except KafkaException:
        return False

"""Why a replicated partition refuses acks=all writes: fewer in-sync replicas than the topic's min.insync.replicas,
listed or answering.

The broker answers such a write NOT_ENOUGH_REPLICAS, a retriable error: both clients retry it until the delivery
timeout and then report only the timeout (librdkafka "Message timed out", kafka-python "Expiring N record(s)").
When a delivery failed, :func:`not_enough_replicas` asks the cluster for the partitions' in-sync replicas, so the
error names the broker's reason instead. A cluster that lost its controller quorum cannot shrink an in-sync set
(two of three brokers gone at once): the set still lists the dead brokers, so their addresses are tried too.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, BrokerMetadata, ConfigResource, ResourceType

from kbit_core.config import KafkaConfig
from kbit_core.kafka.settings import confluent_options

log = logging.getLogger(__name__)

# The question is asked after a delivery already failed: a cluster that cannot answer at once gets no longer.
DIAGNOSIS_TIMEOUT_S = 3.0
# A TCP connection to each in-sync replica's broker: refused at once when it is down, this long when cut off.
CONNECT_TIMEOUT_S = 1.0


def not_enough_replicas(kcfg: KafkaConfig, topic: str, partitions: Iterable[int]) -> dict[int, str]:
    """partition -> 'NOT_ENOUGH_REPLICAS: ...' for each of ``partitions`` whose in-sync replicas, or those of them
    whose brokers take a connection, are fewer than the topic's min.insync.replicas; empty when none is short or the
    cluster cannot tell (it is then unreachable, and the clients' own errors say so)."""
    timeout = min(DIAGNOSIS_TIMEOUT_S, kcfg.request_timeout_s)
    client = AdminClient({**confluent_options(kcfg), "log_level": 0})
    try:
        cluster = client.list_topics(topic, timeout=timeout)
        meta = cluster.topics[topic]
        resource = ConfigResource(ResourceType.TOPIC, topic)
        entries = client.describe_configs([resource], request_timeout=timeout)[resource].result(timeout=timeout)
        min_isr = int(entries["min.insync.replicas"].value)
    except (KafkaException, KeyError, ValueError, TypeError) as exc:
        log.debug("cannot ask for the in-sync replicas of %s: %s", topic, exc)
        return {}
    short, silence = {}, {}  # broker id -> why it takes no connection (None: it takes one), asked once each
    for p in partitions:
        part = meta.partitions.get(p)
        if part is None:
            continue
        if len(part.isrs) < min_isr:
            short[p] = (
                f"NOT_ENOUGH_REPLICAS: its in-sync replicas {sorted(part.isrs)} (of replicas {sorted(part.replicas)}) "
                f"are fewer than the topic's min.insync.replicas={min_isr}, so the brokers refuse acks=all writes"
            )
            continue
        for b in part.isrs:
            if b not in silence:
                silence[b] = _unanswered(cluster.brokers.get(b))
        silent = {b: silence[b] for b in part.isrs if silence[b]}
        if len(part.isrs) - len(silent) < min_isr:
            short[p] = (
                f"NOT_ENOUGH_REPLICAS: of its in-sync replicas {sorted(part.isrs)} (of replicas "
                f"{sorted(part.replicas)}) broker(s) {'; '.join(f'{b} {why}' for b, why in sorted(silent.items()))}: "
                f"fewer than the topic's min.insync.replicas={min_isr} answer, so no acks=all write is acknowledged"
            )
    return short


def _unanswered(broker: BrokerMetadata | None) -> str | None:
    """Why ``broker`` (metadata's host and port) takes no TCP connection, or None when it takes one."""
    if broker is None:
        return "is not in the cluster's metadata"
    try:
        socket.create_connection((broker.host, broker.port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return f"at {broker.host}:{broker.port} does not answer ({exc.strerror or exc})"
    return None

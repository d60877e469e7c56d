"""Why a replicated partition refuses acks=all writes: fewer in-sync replicas than the topic's min.insync.replicas.

The broker answers such a write NOT_ENOUGH_REPLICAS, a retriable error: both clients retry it until the delivery
timeout and then report only the timeout (librdkafka "Message timed out", kafka-python "Expiring N record(s)").
When a delivery failed, :func:`not_enough_replicas` asks the cluster for the partitions' in-sync replicas, so the
error names the broker's reason instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from kbit_core.config import KafkaConfig
from kbit_core.kafka.settings import confluent_options

log = logging.getLogger(__name__)

# The question is asked after a delivery already failed: a cluster that cannot answer at once gets no longer.
DIAGNOSIS_TIMEOUT_S = 3.0


def not_enough_replicas(kcfg: KafkaConfig, topic: str, partitions: Iterable[int]) -> dict[int, str]:
    """partition -> 'NOT_ENOUGH_REPLICAS: ...' for each of ``partitions`` whose in-sync replicas are fewer than the
    topic's min.insync.replicas; empty when none is short or the cluster cannot tell (it is then unreachable, and
    the clients' own errors say so)."""
    timeout = min(DIAGNOSIS_TIMEOUT_S, kcfg.request_timeout_s)
    client = AdminClient({**confluent_options(kcfg), "log_level": 0})
    try:
        meta = client.list_topics(topic, timeout=timeout).topics[topic]
        resource = ConfigResource(ResourceType.TOPIC, topic)
        entries = client.describe_configs([resource], request_timeout=timeout)[resource].result(timeout=timeout)
        min_isr = int(entries["min.insync.replicas"].value)
    # TimeoutError: a future not done in time (a cluster that lost its quorum, two full disks on the bed)
    except (KafkaException, KeyError, ValueError, TypeError, TimeoutError) as exc:
        log.debug("cannot ask for the in-sync replicas of %s: %s", topic, exc)
        return {}
    short = {}
    for p in partitions:
        part = meta.partitions.get(p)
        if part is not None and len(part.isrs) < min_isr:
            short[p] = (
                f"NOT_ENOUGH_REPLICAS: its in-sync replicas {sorted(part.isrs)} (of replicas {sorted(part.replicas)}) "
                f"are fewer than the topic's min.insync.replicas={min_isr}, so the brokers refuse acks=all writes"
            )
    return short

"""Why a replicated partition refuses acks=all writes: fewer in-sync replicas than the topic's min.insync.replicas.

The broker answers such a write NOT_ENOUGH_REPLICAS, a retriable error: both clients retry it until the delivery
timeout and then report only the timeout (librdkafka "Message timed out", kafka-python "Expiring N record(s)").
When a delivery failed, :func:`not_enough_replicas` asks the cluster for the partitions' in-sync replicas, so the
error names the broker's reason instead; where the replicas are all still in sync on paper, it names those whose
brokers accept no connections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from kbit_core.config import KafkaConfig
from kbit_core.kafka.settings import confluent_options
from kbit_core.service import port_open

log = logging.getLogger(__name__)

# The question is asked after a delivery already failed: a cluster that cannot answer at once gets no longer.
DIAGNOSIS_TIMEOUT_S = 3.0


def not_enough_replicas(kcfg: KafkaConfig, topic: str, partitions: Iterable[int]) -> dict[int, str]:
    """partition -> the broker's reason for each of ``partitions`` that cannot take acks=all writes: 'NOT_ENOUGH_REPLICAS:
    ...' when its in-sync replicas are fewer than the topic's min.insync.replicas, else the replicas whose brokers
    accept no connections (brokers that died before the controller could take them out of the in-sync replicas: two
    of three halted by full disks take the KRaft quorum with them); empty when the cluster cannot tell (it is then
    unreachable, and the clients' own errors say so)."""
    timeout = min(DIAGNOSIS_TIMEOUT_S, kcfg.request_timeout_s)
    client = AdminClient({**confluent_options(kcfg), "log_level": 0})
    try:
        cluster = client.list_topics(topic, timeout=timeout)
        meta = cluster.topics[topic]
    except (KafkaException, KeyError) as exc:
        log.debug("cannot ask for the in-sync replicas of %s: %s", topic, exc)
        return {}
    min_isr = _min_insync_replicas(client, topic, timeout)
    short = {}
    for p in partitions:
        part = meta.partitions.get(p)
        if part is None:
            continue
        if min_isr is not None and len(part.isrs) < min_isr:
            short[p] = (
                f"NOT_ENOUGH_REPLICAS: its in-sync replicas {sorted(part.isrs)} (of replicas {sorted(part.replicas)}) "
                f"are fewer than the topic's min.insync.replicas={min_isr}, so the brokers refuse acks=all writes"
            )
            continue
        addresses = {r: cluster.brokers[r] for r in sorted(part.replicas) if r in cluster.brokers}
        down = [f"{r} ({b.host}:{b.port})" for r, b in addresses.items() if not port_open(b.host, b.port)]
        unlisted = sorted(set(part.replicas) - set(addresses))
        if down:
            fenced = f"; replica(s) {unlisted} not listed by the cluster (fenced)" if unlisted else ""
            short[p] = (
                f"its replicas on broker(s) {', '.join(down)} accept no connections: down (their logs say why, "
                f"e.g. 'No space left on device' for a full log directory), with their places in the in-sync "
                f"replicas {sorted(part.isrs)} kept{fenced}"
            )
    return short


def _min_insync_replicas(client: AdminClient, topic: str, timeout: float) -> int | None:
    """The topic's min.insync.replicas; None when the cluster cannot tell."""
    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        entries = client.describe_configs([resource], request_timeout=timeout)[resource].result(timeout=timeout)
        return int(entries["min.insync.replicas"].value)
    # TimeoutError: a future not done in time (a cluster that lost its quorum, two full disks on the bed)
    except (KafkaException, KeyError, ValueError, TypeError, TimeoutError) as exc:
        log.debug("cannot ask for the min.insync.replicas of %s: %s", topic, exc)
        return None

"""Several Apache Kafka KRaft nodes as one replicated cluster: every node is a broker and a controller, the nodes
form a static quorum of voters, and topics are replicated to three of them with min.insync.replicas=2.

Used by the test bed (one node per bed host, TLS and SCRAM, :mod:`kbit_core.testbed.kafka_bed`) and by the fault
tests (three nodes on 127.0.0.1 ports, plaintext). The nodes start together: a controller quorum needs a majority
of its voters before any broker can register.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from kbit_core.brokers.apache_broker import ApacheKafkaBroker, new_cluster_id
from kbit_core.errors import BrokerError

__all__ = ["ClusterNode", "KafkaCluster"]

# A metadata round trip of the readiness check.
READY_TIMEOUT_S = 2.0
# The nodes' JIT stops at C1: three brokers starting together on 2 cores took 25 CPU-seconds to serve with the full
# JIT and 12 with C1 only (65 s and 28 s of wall time at load 25-29; TLS and SCRAM on, measured 2026-11-25). The
# clusters serve the test bed and the fault tests, never a throughput ceiling: the single local broker that
# `kbit bench-data` measures keeps the full JIT.
CLUSTER_JVM_OPTS = ("-XX:TieredStopAtLevel=1",)


@dataclass(frozen=True)
class ClusterNode:
    name: str  # the node's files are under run_dir/<name>, its process is the Service <name>
    host: str  # the address its listeners bind to
    port: int  # clients
    controller_port: int
    launch: Callable[[list[str]], list[str]] | None = None  # wraps its command line, e.g. into a network namespace


def replication_properties(nodes: int) -> dict[str, str]:
    """Every topic, internal ones included, on up to three nodes; a write needs two in-sync replicas when there are."""
    factor, min_isr = str(min(nodes, 3)), str(min(nodes, 2))
    return {
        "default.replication.factor": factor,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": factor,
        "transaction.state.log.replication.factor": factor,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": factor,
        "share.coordinator.state.topic.min.isr": min_isr,
        # a leader that comes back takes its partitions back within seconds, not the default 5 minutes
        "leader.imbalance.check.interval.seconds": "5",
        # a starting broker registers, catches up and is unfenced in heartbeats: 0.5 s apart, not 2 s
        "broker.heartbeat.interval.ms": "500",
    }


class KafkaCluster:
    """The nodes' brokers, started and stopped together; ``properties(node)`` adds each node's own settings
    (listeners, security), and ``admin_options`` are the confluent options an administrator connects with
    (the bootstrap is added: ``admin_bootstrap(node)``, by default the node's client address). ``kafka_version``:
    the brokers run that installed release (:func:`kafka_libs`), not the default one."""

    def __init__(
        self,
        run_dir: Path,
        nodes: list[ClusterNode],
        *,
        properties: Callable[[ClusterNode], dict[str, str]] = lambda node: {},
        admin_options: dict[str, Any] | None = None,
        admin_bootstrap: Callable[[ClusterNode], str] = lambda node: f"{node.host}:{node.port}",
        env: dict[str, str] | None = None,
        heap_max: str = "512m",
        kafka_version: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.nodes = nodes
        self.admin_options = dict(admin_options or {})
        self.admin_bootstrap = admin_bootstrap
        voters = ",".join(f"{i}@{n.host}:{n.controller_port}" for i, n in enumerate(nodes, 1))
        self.brokers = [
            ApacheKafkaBroker(
                self.run_dir,
                node.host,
                node.port,
                controller_port=node.controller_port,
                env=env,
                heap_max=heap_max,
                name=node.name,
                node_id=i,
                voters=voters,
                overrides=replication_properties(len(nodes)) | properties(node),
                launch=node.launch,
                jvm_opts=CLUSTER_JVM_OPTS,
                kafka_version=kafka_version,
                # a plaintext node answers the broker's own metadata probe once it serves; a secured one an admin
                ready=(lambda i=i, node=node: i in self._registered(node)) if self.admin_options else None,
            )
            for i, node in enumerate(nodes, 1)
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)

    def admin(self, nodes: list[ClusterNode] | None = None) -> AdminClient:
        """An admin client (``admin_options``) bootstrapping from ``nodes`` (default: all)."""
        servers = ",".join(self.admin_bootstrap(n) for n in (nodes or self.nodes))
        return AdminClient({**self.admin_options, "bootstrap.servers": servers, "log_level": 0})

    def _registered(self, node: ClusterNode) -> set[int]:
        """The broker ids the metadata of ``node`` lists (empty while it cannot answer)."""
        try:
            return set(self.admin([node]).list_topics(timeout=READY_TIMEOUT_S).brokers)
        except Exception:  # any client error means: not serving yet
            return set()

    def start(self, timeout_s: float = 240.0) -> None:
        """Start every node that is not running (in parallel: the quorum needs a majority) and wait until each one's
        metadata lists itself. One cluster id for all, kept in each node's directory."""
        cluster_id = next((b.cluster_id() for b in self.brokers if b.cluster_id_path.is_file()), new_cluster_id())
        for broker in self.brokers:
            if not broker.cluster_id_path.is_file():
                broker.home.mkdir(parents=True, exist_ok=True)
                broker.cluster_id_path.write_text(cluster_id + "\n")
        failure = None
        with ThreadPoolExecutor(len(self.brokers)) as pool:
            for started in as_completed([pool.submit(b.start, timeout_s) for b in self.brokers]):
                if started.exception() is not None and failure is None:
                    # The first broker to fail says why; the others would only fail later for want of it (no quorum),
                    # so they stop now rather than at their deadline.
                    failure = started.exception()
                    self.stop()
        if failure is not None:
            self.stop()  # one that was still formatting its log directory started after the first stop
            raise BrokerError(f"the Apache Kafka cluster at {self.bootstrap} did not start: {failure}")

    def stop(self, timeout_s: float | None = None) -> list[str]:
        """Stop every node together (one by one, the last ones would wait for a quorum that is gone); the names of
        those that were running."""
        with ThreadPoolExecutor(len(self.brokers)) as pool:
            stopped = list(pool.map(lambda b: b.stop(timeout_s), self.brokers))
        return [b.service.name for b, was in zip(self.brokers, stopped) if was]

    def wipe(self) -> None:
        for broker in self.brokers:
            broker.wipe()

    def leader_of(self, topic: str, partition: int) -> ApacheKafkaBroker:
        """The broker leading ``topic``'s ``partition`` now."""
        meta = self.admin().list_topics(topic, timeout=10).topics[topic]
        leader = meta.partitions[partition].leader
        return self.brokers[leader - 1]

    def in_sync(self, topic: str) -> dict[int, list[int]]:
        """Partition -> the node ids of its in-sync replicas."""
        meta = self.admin().list_topics(topic, timeout=10).topics[topic]
        return {p: sorted(m.isrs) for p, m in meta.partitions.items()}

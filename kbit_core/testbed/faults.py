"""What Kafka operators do to a cluster while jobs read it, scripted on the test bed's brokers: a rolling restart
with controlled shutdown, a broker cut off from everyone by nftables while it runs, the active KRaft controller
killed. Each fault ends only once the cluster is whole again (every broker serving, every partition's in-sync
replicas complete) and returns what it did, timed (``kbit cluster fault NAME``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka.admin import AdminClient

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.brokers.cluster import KafkaCluster
from kbit_core.kafka.settings import confluent_options
from kbit_core.testbed.certs import certificate_paths
from kbit_core.testbed.kafka_bed import BedKafkaPorts, bed_kafka
from kbit_core.testbed.marked import MARKER_ENV
from kbit_core.testbed.network import Host, TestbedError, Topology
from kbit_core.testbed.state import BedOptions, BedState, load_state

FAULTS = ("rolling-restart", "cut-off", "kill-controller")
CUT_OFF_TABLE = "kbit_cut_off"
# How long the cluster may take to be whole again after a fault: a broker's restart on the loaded 2-core machine
# took up to 90 s (three JVMs, TLS) and its replicas catch up after it.
WHOLE_AGAIN_S = 300.0
_POLL_S = 0.25


@dataclass
class BedBrokers:
    """The running bed's brokers, each with its host, and the ports they serve."""

    cluster: KafkaCluster
    hosts: tuple[Host, ...]
    ports: BedKafkaPorts
    client_options: dict  # the training user's confluent options (its connections use the client port)

    @classmethod
    def of(cls, bed_dir: Path) -> BedBrokers:
        state = load_state(bed_dir)
        if state is None:
            raise TestbedError(f"no test bed is up at {bed_dir}: `kbit cluster up` first")
        return cls.from_state(state)

    @classmethod
    def from_state(cls, state: BedState) -> BedBrokers:
        options = BedOptions(**state.options)
        hosts = Topology.build(options.subnet, options.nodes).hosts
        ports = BedKafkaPorts(options.broker_port, options.broker_internal_port, options.broker_controller_port)
        certs = certificate_paths(Path(state.bed_dir) / "certs")
        run_dir, marker = Path(state.bed_dir) / "run", {MARKER_ENV: str(state.bed_dir)}  # as `up` starts them
        kafka = state.kafka_config()
        cluster = bed_kafka(run_dir, hosts, ports, certs, options.client_auth, marker, options.kafka_version)
        return cls(cluster, hosts, ports, {**confluent_options(kafka), "log_level": 0})

    def broker(self, name: str) -> tuple[ApacheKafkaBroker, Host]:
        """The broker of host ``name`` (driver, node1, ...) or named ``name`` (kafka-node1)."""
        for broker, host in zip(self.cluster.brokers, self.hosts):
            if name in (host.name, broker.service.name):
                return broker, host
        raise TestbedError(f"the bed has no broker {name!r}; its hosts are {', '.join(h.name for h in self.hosts)}")

    def leader_of(self, topic: str, partition: int) -> tuple[ApacheKafkaBroker, Host]:
        leader = self.cluster.leader_of(topic, partition)
        return leader, self.hosts[self.cluster.brokers.index(leader)]


@dataclass
class FaultReport:
    fault: str
    steps: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"fault": self.fault, "seconds": round(self.seconds, 1), "steps": self.steps}


def wait_whole(cluster: KafkaCluster, timeout_s: float = WHOLE_AGAIN_S) -> float:
    """Wait until every broker is listed and every partition's in-sync replicas are all its replicas; the seconds
    that took. TestbedError naming the partitions still short at the deadline."""
    started = time.monotonic()
    short: dict[str, list[int]] = {"metadata": []}
    while time.monotonic() - started < timeout_s:
        try:
            meta = cluster.admin().list_topics(timeout=5)
        except Exception as exc:  # any client error: not answering yet
            short = {"metadata": [], "error": str(exc)}  # type: ignore[dict-item]
        else:
            short = {
                f"{t}[{p}]": sorted(m.isrs)
                for t, tm in meta.topics.items()
                for p, m in tm.partitions.items()
                if set(m.isrs) != set(m.replicas)
            }
            if len(meta.brokers) == len(cluster.brokers) and not short:
                return time.monotonic() - started
        time.sleep(_POLL_S)
    raise TestbedError(f"the bed's Kafka cluster was not whole again within {timeout_s:.0f}s: short {short}")


def rolling_restart(bed: BedBrokers) -> FaultReport:
    """Each broker in turn: SIGTERM (a controlled shutdown: it hands its leaderships over first), start it again on
    its data, wait until the cluster is whole, then the next."""
    report = FaultReport("rolling-restart")
    started = time.monotonic()
    report.steps = [restart_broker(bed, broker) for broker in bed.cluster.brokers]
    report.seconds = time.monotonic() - started
    return report


def restart_broker(bed: BedBrokers, broker: ApacheKafkaBroker) -> dict:
    """One step of a rolling restart: SIGTERM to ``broker`` (a controlled shutdown), start it again on its data (and
    its ``kafka_version``'s jars), wait until the cluster is whole; the step, timed."""
    stopping = time.monotonic()
    broker.stop()
    stopped = time.monotonic()
    broker.start(timeout_s=WHOLE_AGAIN_S)
    serving = time.monotonic()
    caught_up = wait_whole(bed.cluster)
    return {
        "broker": broker.service.name,
        "shutdown_s": round(stopped - stopping, 1),
        "down_s": round(serving - stopped, 1),
        "in_sync_after_s": round(caught_up, 1),
    }


def cut_off_ruleset(address: str, ports: BedKafkaPorts) -> str:
    """nftables input for the broker's host: every packet to or from the broker's ports dropped, and its own
    connections to the other brokers (their internal and controller ports). Its host's other traffic passes."""
    served = f"{{ {ports.client}, {ports.internal}, {ports.controller} }}"
    peers = f"{{ {ports.internal}, {ports.controller} }}"
    return (
        f"table inet {CUT_OFF_TABLE} {{\n"
        f"  chain in {{ type filter hook input priority -10;\n"
        f"    ip daddr {address} tcp dport {served} drop;\n    ip daddr {address} tcp sport {peers} drop;\n  }}\n"
        f"  chain out {{ type filter hook output priority -10;\n"
        f"    ip saddr {address} tcp sport {served} drop;\n    ip saddr {address} tcp dport {peers} drop;\n  }}\n"
        f"}}\n"
    )


def _nft(host: Host, *args: str, stdin: str | None = None, check: bool = True) -> bool:
    """Run nft in ``host``'s namespace; whether it succeeded (TestbedError with its error when ``check``)."""
    argv = ["nft", *args] if host.netns is None else ["ip", "netns", "exec", host.netns, "nft", *args]
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.returncode == 0


def heal_cut_offs(hosts: tuple[Host, ...]) -> list[str]:
    """Remove a cut-off's nftables table from every host where one is left (a process that ended during the cut-off
    never healed it; the driver host's is in the root namespace, which outlives the bed); the hosts healed."""
    return [host.name for host in hosts if _nft(host, "delete", "table", "inet", CUT_OFF_TABLE, check=False)]


def cut_off(
    bed: BedBrokers, broker: ApacheKafkaBroker, host: Host, seconds: float, until_fenced: bool = False
) -> FaultReport:
    """The broker keeps running, but for ``seconds`` (and with ``until_fenced`` until the controller fenced it, at
    most WHOLE_AGAIN_S) nothing reaches it and it reaches nothing (clients, the other brokers, the quorum); then its
    traffic passes again and it rejoins. On the broker's host only: the host's other processes (a rank, Spark) keep
    their links, except their own connections to the other brokers' internal and controller ports (the broker's
    super-user administrator's; kbit's clients use the client port)."""
    report = FaultReport("cut-off")
    started = time.monotonic()
    _nft(host, "-f", "-", stdin=cut_off_ruleset(host.address, bed.ports))
    try:
        fenced = _fenced_within(bed, broker, started + seconds, started + WHOLE_AGAIN_S if until_fenced else None)
    finally:
        _nft(host, "delete", "table", "inet", CUT_OFF_TABLE)
    healed = time.monotonic()
    caught_up = wait_whole(bed.cluster)
    report.steps.append(
        {
            "broker": broker.service.name,
            "cut_s": round(healed - started, 1),
            "fenced_after_s": None if fenced is None else round(fenced - started, 1),
            "in_sync_after_s": round(caught_up, 1),
        }
    )
    report.seconds = time.monotonic() - started
    return report


def _fenced_within(
    bed: BedBrokers, broker: ApacheKafkaBroker, until: float, or_fenced_by: float | None
) -> float | None:
    """Watch the other brokers' metadata until ``until`` (and, given ``or_fenced_by``, on until ``broker`` is fenced
    or that moment): the moment it stopped listing ``broker`` (the controller fenced it: its session timed out), or
    None. Asked as the training user on the client port: on the cut-off broker's host, connections to the other
    brokers' internal port (the administrator's) are cut too."""
    others = ",".join(b.bootstrap for b in bed.cluster.brokers if b is not broker)
    watcher = AdminClient({**bed.client_options, "bootstrap.servers": others})
    fenced = None
    while True:
        now = time.monotonic()
        end = until if fenced is not None or or_fenced_by is None else max(until, or_fenced_by)
        if now >= end:
            return fenced
        if fenced is None:
            try:
                listed = watcher.list_topics(timeout=max(0.5, min(5.0, end - now)))
            except Exception:  # any client error: no answer this time
                listed = None
            if listed is not None and broker.node_id not in listed.brokers:
                fenced = time.monotonic()
        time.sleep(min(_POLL_S, max(0.0, end - time.monotonic())))


def active_controller(bed: BedBrokers) -> ApacheKafkaBroker:
    """The broker whose controller leads the KRaft quorum, by the newest epoch among the voters' quorum-state files."""
    newest = (-1, None)
    for broker in bed.cluster.brokers:
        try:
            state = json.loads((broker.data_dir / "__cluster_metadata-0" / "quorum-state").read_text())
        except (OSError, ValueError):
            continue
        if state.get("leaderId", -1) >= 1 and state.get("leaderEpoch", -1) > newest[0]:
            newest = (state["leaderEpoch"], state["leaderId"])
    if newest[1] is None:
        raise TestbedError("no voter of the bed's KRaft quorum knows a leader")
    return bed.cluster.brokers[int(newest[1]) - 1]


def kill_controller(bed: BedBrokers) -> FaultReport:
    """SIGKILL the active controller's broker; once another voter leads the quorum, start it again on its data."""
    report = FaultReport("kill-controller")
    started = time.monotonic()
    victim = active_controller(bed)
    pid = victim.service.pid()
    if pid is None:
        raise TestbedError(f"the active controller's broker {victim.service.name} is not running")
    os.kill(pid, signal.SIGKILL)
    while (new_leader := active_controller(bed)) is victim:
        if time.monotonic() - started > WHOLE_AGAIN_S:
            raise TestbedError(f"no new KRaft leader within {WHOLE_AGAIN_S:.0f}s of killing {victim.service.name}")
        time.sleep(_POLL_S)
    elected = time.monotonic()
    victim.start(timeout_s=WHOLE_AGAIN_S)
    caught_up = wait_whole(bed.cluster)
    report.steps.append(
        {
            "broker": victim.service.name,
            "new_leader_after_s": round(elected - started, 1),
            # the voter that took over, not the leader after the restart: the restarted victim may win a later
            # election (seen on the loaded bed: it led the quorum again one second after it started again)
            "new_leader": new_leader.service.name,
            "in_sync_after_s": round(caught_up, 1),
        }
    )
    report.seconds = time.monotonic() - started
    return report

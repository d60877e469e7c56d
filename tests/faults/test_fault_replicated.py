"""Broker faults on a replicated Apache Kafka cluster: three KRaft nodes on 127.0.0.1 (each a broker and a voter),
topics replicated three times with min.insync.replicas=2, kbit's producers with acks=all and idempotence.

The same cluster as the test bed's (:class:`kbit_core.brokers.cluster.KafkaCluster`), without namespaces, TLS or
SCRAM: what is proven here is what replication does for kbit's reads, produces and resumes.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from confluent_kafka.admin import ConfigResource

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.brokers.cluster import ClusterNode, KafkaCluster
from kbit_core.data.reader import RangeReader
from kbit_core.errors import BrokerError, TopicError
from kbit_core.formats import get_codec
from kbit_core.jobs.train import train
from kbit_core.kafka import admin, contents, offsets
from kbit_core.kafka.manifest import Manifest
from kbit_core.kafka.producers import DeliveryLedger, ProducerBackend, delivery_timeout_ms, make_producer
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.stream_log import StreamLog
from kbit_core.train import checkpoint as ckpt
from tests.conftest import FAULT_MODELS_DIR, SMALL_TRAINING, Background, free_port, require_apache_kafka

pytestmark = [pytest.mark.kafka, pytest.mark.own_broker]

# The controller fences a broker that stopped heartbeating after broker.session.timeout.ms (default 9 s) and only
# then moves its leaderships and shrinks the in-sync replicas: 3 s keeps each kill's failover short.
FAST_FAILOVER = {"broker.session.timeout.ms": "3000"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    require_apache_kafka()
    nodes = [ClusterNode(f"kafka-{i}", "127.0.0.1", free_port(), free_port()) for i in (1, 2, 3)]
    started = KafkaCluster(tmp_path_factory.mktemp("cluster"), nodes, properties=lambda node: FAST_FAILOVER)
    started.start()  # three JVMs on a loaded 2-core machine: 20-30 s alone, over 90 s at load 20-30
    yield started
    # Its data is thrown away: 5 s, not the default 30 s, for a controlled shutdown of all three at once
    started.stop(timeout_s=5)


@pytest.fixture
def on_cluster(cluster: KafkaCluster, make_config, topic_name):
    """make_config on the cluster (topics replicated three times) with this test's topic; every node runs again
    after the test, whatever it stopped."""

    def _make(overrides: dict | None = None, **dotted):
        return make_config(
            overrides,
            produce__topic=topic_name,
            kafka__bootstrap_servers=cluster.bootstrap,
            kafka__topic_replication_factor=3,
            **dotted,
        )

    yield _make
    cluster.start()
    every_broker_listed(cluster)


def every_broker_listed(cluster: KafkaCluster, timeout_s: float = 120) -> None:
    """Wait until the cluster's metadata lists every node. A broker thawed after a freeze (SIGSTOP) runs, so
    ``start`` leaves it be, but the controller fenced it and lists it again only after its next heartbeat: a test that
    froze the first two brokers listed meanwhile froze every broker that answers (1 run in 4 here)."""
    deadline = time.monotonic() + timeout_s
    while len(cluster.admin().list_topics(timeout=30).brokers) < len(cluster.brokers):
        assert time.monotonic() < deadline, f"the cluster does not list all {len(cluster.brokers)} brokers"
        time.sleep(0.5)


def every_node_agrees(cluster: KafkaCluster, topic: str, timeout_s: float = 60) -> None:
    """Wait until each node's own metadata names the same leader and all nodes in sync for each of ``topic``'s
    partitions. A leader thawed after a freeze (SIGSTOP) serves the metadata it had before it, itself the leader,
    until it has caught up with the controller. On CI (2026-12-06) a ListOffsets right after the thaw answered
    partition 0's log end from before the freeze while the producer's manifest, every record acknowledged, held the
    whole; the thawed leader answering from its stale view is the explanation that fits (not reproduced idle here)."""
    deadline = time.monotonic() + timeout_s
    everyone = sorted(b.node_id for b in cluster.brokers)
    while True:
        views = []
        for node in cluster.nodes:
            partitions = cluster.admin([node]).list_topics(topic, timeout=30).topics[topic].partitions
            views.append({p: (m.leader, sorted(m.isrs)) for p, m in partitions.items()})
        if all(view == views[0] for view in views) and all(isr == everyone for _, isr in views[0].values()):
            return
        assert time.monotonic() < deadline, f"the nodes' metadata of {topic} still differs: {views}"
        time.sleep(0.5)


def _read_indices(cfg, manifest: Manifest) -> list[int]:
    v = manifest.variant
    codec = get_codec(v.format, v.layout, manifest.dataset.image_shape, v.records_per_message)
    ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
        return sorted(int(i) for _, batch in reader.read(ranges) for i in batch.indices)


def _kill(broker) -> None:
    os.kill(broker.service.pid(), signal.SIGKILL)


def test_topics_are_replicated_three_times_with_two_in_sync_needed(on_cluster, cluster: KafkaCluster):
    cfg = on_cluster(dataset__num_records=200)
    manifest = produce_dataset(cfg, progress=False)
    assert cluster.in_sync(manifest.topic) == {0: [1, 2, 3], 1: [1, 2, 3]}
    client = cluster.admin()
    (config,) = client.describe_configs([ConfigResource("topic", manifest.topic)]).values()
    assert config.result(timeout=10)["min.insync.replicas"].value == "2"


@pytest.mark.slow
def test_leader_killed_mid_epoch_training_matches_an_uninterrupted_run(
    on_cluster, cluster: KafkaCluster, topic_name, fault_models_importable, monkeypatch, record_property
):
    """Rank 0 SIGKILLs the leader of partition 0 at step 3 of 25: the readers follow the new leader, and the run
    ends with the weights of a run without the kill."""
    monkeypatch.syspath_prepend(str(FAULT_MODELS_DIR))  # torchrun's ranks get the driver's sys.path

    def run(name: str, at_step: int) -> dict:
        cfg = on_cluster(
            SMALL_TRAINING,
            launch__engine="torchrun",
            train__model={
                "name": "fault_models:kill_leader",
                "kwargs": {
                    "at_step": at_step,
                    "bootstrap": cluster.bootstrap,
                    "topic": topic_name,
                    "run_dir": str(cluster.run_dir),
                },
            },
            checkpoint={"dir": name, "every_epoch": True},
        )
        return train(cfg, progress=False)

    clean = run("ckpt-clean", 0)
    leader_before = cluster.leader_of(topic_name, 0).node_id
    started = time.monotonic()
    killed = run("ckpt-killed", 3)
    record_property("seconds", round(time.monotonic() - started, 2))
    assert int((cluster.run_dir / "killed").read_text()) == leader_before
    assert cluster.leader_of(topic_name, 0).node_id != leader_before
    assert killed["loss_curve"] == clean["loss_curve"] and killed["test_accuracy"] == clean["test_accuracy"]
    ours, theirs = (ckpt.read_file(Path(r["checkpoint"]))[ckpt.MODEL] for r in (killed, clean))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_broker_killed_mid_produce_loses_and_duplicates_nothing(
    on_cluster, cluster: KafkaCluster, topic_name, monkeypatch: pytest.MonkeyPatch
):
    """The leader of partition 0 is SIGKILLed as the producer sends message 2,000 of 4,000, with the batches before
    it in flight or acknowledged: the idempotent producer retries to the new leader, the manifest is exact and every
    record is there once."""
    records, kill_at = 4000, 2000
    cfg = on_cluster(SMALL_TRAINING, dataset__num_records=records, produce__partitions=3, kafka__request_timeout_s=5)
    killed: list[ApacheKafkaBroker] = []

    def producer_killing_the_leader(*args, **kwargs) -> ProducerBackend:
        backend = make_producer(*args, **kwargs)
        send, sent = backend.send, itertools.count(1)

        def send_then_kill(topic: str, partition: int, *rest) -> None:
            if next(sent) == kill_at:
                killed.append(cluster.leader_of(topic, 0))
                _kill(killed[0])
            send(topic, partition, *rest)

        backend.send = send_then_kill  # type: ignore[method-assign]
        return backend

    monkeypatch.setattr("kbit_core.produce.make_producer", producer_killing_the_leader)
    manifest = produce_dataset(cfg, progress=False)
    assert killed and killed[0].service.pid() is None
    assert cluster.leader_of(topic_name, 0) is not killed[0]
    assert contents.check_topic(cfg.kafka, manifest).holds_manifest
    assert manifest.num_records == records and _read_indices(cfg, manifest) == list(range(records))


@pytest.mark.slow
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_two_of_three_brokers_stopped_produce_fails_clearly_and_nothing_acknowledged_is_lost(
    on_cluster, cluster: KafkaCluster, topic_name, client, record_property
):
    """With one in-sync replica left (min.insync.replicas=2), an acks=all produce to the topic fails within the
    delivery timeout, naming each partition; the records acknowledged before are all there afterwards."""
    cfg = on_cluster(dataset__num_records=2000, kafka__request_timeout_s=3)
    kept = produce_dataset(cfg, progress=False)
    last = cluster.brokers[2]
    for broker in cluster.brokers[:2]:  # one at a time: each hands its leaderships over and leaves the ISR
        broker.stop()
    assert set(cluster.in_sync(topic_name)[0]) == {last.node_id}
    ledger = DeliveryLedger(topic_name, 2, cfg.kafka)
    producer = make_producer(cfg.kafka, cfg.produce, "none", client)
    started = time.monotonic()
    try:
        for i in range(10):
            producer.send(topic_name, i % 2, b"k", b"more", ledger.callback(1, 4))
        producer.flush(delivery_timeout_ms(cfg.kafka) / 1000 + 10)
    except BrokerError as exc:
        # kafka-python sometimes expires its retried in-flight batches only after flush's deadline (1 run of the
        # suite in many); its error then names the broker's answer, and nothing was delivered.
        assert client == "kafka-python" and "NotEnoughReplicasError" in str(exc), exc
        assert "\n" not in str(exc) and ledger.delivered_records == 0, exc
    else:
        with pytest.raises(BrokerError) as caught:
            ledger.raise_errors()
        message = str(caught.value)
        # The broker answers NOT_ENOUGH_REPLICAS, which both clients retry until the delivery timeout and then
        # report as a timeout; the ledger asks the cluster why and names it, on one line, for each partition.
        assert "\n" not in message, message
        for p in (0, 1):
            assert (
                f"{topic_name}[{p}]: 5 message(s) failed: NOT_ENOUGH_REPLICAS: its in-sync replicas "
                f"[{last.node_id}] (of replicas [1, 2, 3]) are fewer than the topic's min.insync.replicas=2" in message
            ), message
        assert ledger.delivered_records == 0
    finally:
        producer.close()
    record_property("seconds", round(time.monotonic() - started, 2))
    cluster.start()
    assert contents.check_topic(cfg.kafka, kept).holds_manifest
    assert _read_indices(cfg, kept) == list(range(2000))


def test_a_broker_restarted_with_its_disk_keeps_the_topic_and_nothing_is_produced_again(
    on_cluster, cluster: KafkaCluster, topic_name, monkeypatch: pytest.MonkeyPatch
):
    cfg = on_cluster(dataset__num_records=500)
    manifest = produce_dataset(cfg, progress=False)
    ends = offsets.exact_end_offsets(cfg.kafka, topic_name)
    leader = cluster.leader_of(topic_name, 0)
    leader.stop()
    cluster.start()
    monkeypatch.setattr("kbit_core.produce._produce", lambda *a, **k: pytest.fail("produced again"))
    assert produce_dataset(cfg, progress=False) == manifest
    assert offsets.exact_end_offsets(cfg.kafka, topic_name) == ends
    assert _read_indices(cfg, manifest) == list(range(500))


def test_a_replication_factor_the_cluster_never_meets_fails_in_one_line_naming_the_refusal(on_cluster, topic_name):
    """Kafka's INVALID_REPLICATION_FACTOR (a broker not registered, as in a rolling upgrade) is asked again until
    kafka.request_timeout_s passed, then named in one line with the wait; nothing is left created."""
    cfg = on_cluster(kafka__request_timeout_s=2)
    with pytest.raises(TopicError) as refused:
        admin.create_topic(cfg.kafka, topic_name, 2, replication_factor=4)
    message = str(refused.value)
    assert "\n" not in message
    assert f"cannot create topic '{topic_name}' (2 partitions, replication factor 4)" in message
    assert "INVALID_REPLICATION_FACTOR: Unable to replicate the partition 4 time(s)" in message
    assert "asked again for 2s: kafka.request_timeout_s" in message
    assert not admin.topic_exists(cfg.kafka, topic_name)


def test_two_brokers_dead_before_they_leave_the_isr_are_named_in_the_delivery_error(
    on_cluster, cluster: KafkaCluster, topic_name
):
    """Two of three brokers SIGKILLed at once (as Kafka halts a broker whose only log directory filled up): the KRaft
    quorum is lost before the controller can shrink the in-sync replicas, so they still count three; an acks=all
    delivery fails naming, per partition, the replicas whose brokers accept no connections."""
    cfg = on_cluster(dataset__num_records=200, kafka__request_timeout_s=3)
    produce_dataset(cfg, progress=False)
    dead = cluster.brokers[:2]
    for broker in dead:
        _kill(broker)
    ledger = DeliveryLedger(topic_name, 2, cfg.kafka)
    producer = make_producer(cfg.kafka, cfg.produce, "none", "confluent")
    try:
        for i in range(10):
            producer.send(topic_name, i % 2, b"k", b"more", ledger.callback(1, 4))
        producer.flush(delivery_timeout_ms(cfg.kafka) / 1000 + 10)
    finally:
        producer.close()
    with pytest.raises(BrokerError) as caught:
        ledger.raise_errors()
    message = str(caught.value)
    assert "\n" not in message, message
    named = ", ".join(f"{b.node_id} ({b.host}:{b.port})" for b in dead)
    for p in (0, 1):
        assert f"{topic_name}[{p}]: 5 message(s) failed: its replicas on broker(s) {named} accept no connections" in (
            message
        ), message


def test_the_live_producer_rides_through_a_frozen_leader_without_reconnecting(
    on_cluster, cluster: KafkaCluster, topic_name
):
    """The leader of partition 0 frozen (SIGSTOP) for 15 s while the stream producer appends: longer than the 10 s
    after which it used to give up on a chunk and reconnect (and then found the chunk's acknowledged part, left out of
    its manifest, in the topic: a 30 s cut-off on the bed). On a replicated cluster it waits for the idempotent
    producer's retries to reach the new leader: every record once, the manifest matching the broker's offsets."""
    cfg = on_cluster(dataset__num_records=100, kafka__request_timeout_s=10, stream={"topic": topic_name})
    producer = LiveProducer(cfg)
    producer.run(rate=200, records=200)
    leader = cluster.leader_of(topic_name, 0)
    os.kill(leader.service.pid(), signal.SIGSTOP)
    try:
        appending = Background(producer.run, rate=200, records=1000)
        time.sleep(15)
    finally:
        os.kill(leader.service.pid(), signal.SIGCONT)
    run = appending.result(180)
    assert (run.next_index, run.reconnects) == (1000, 0)
    log = StreamLog.load(Path(run.manifest_path))
    every_node_agrees(cluster, topic_name)
    assert offsets.exact_end_offsets(cfg.kafka, topic_name) == log.end_offsets() == {0: 500, 1: 500}


def test_the_broker_limit_is_read_from_a_broker_that_answers_while_others_are_frozen(on_cluster, cluster: KafkaCluster):
    """A new topic's message size limit is a broker's own setting, which only that broker answers; with the first two
    brokers the cluster lists frozen (SIGSTOP: connected, silent, as a cut-off broker is) the third one answers.
    Before, the first listed was asked alone and a produce during a cut-off on the bed failed on its bare
    TimeoutError."""
    cfg = on_cluster()
    listed = list(cluster.admin().list_topics(timeout=30).brokers)
    frozen = [b for b in cluster.brokers if b.node_id in listed[:2]]
    assert len(frozen) == 2
    for broker in frozen:
        os.kill(broker.service.pid(), signal.SIGSTOP)
    try:
        assert admin.max_message_bytes(cfg.kafka, f"{cfg.produce.topic}-not-created") == 1048588
    finally:
        for broker in frozen:
            os.kill(broker.service.pid(), signal.SIGCONT)


def test_a_topic_creation_no_broker_answers_fails_in_one_line(on_cluster, cluster: KafkaCluster, monkeypatch):
    """Every broker frozen once the cluster's metadata was read: CreateTopics gets no answer, and the creation fails
    in one line naming the wait (it was a bare TimeoutError)."""
    cfg = on_cluster(kafka__request_timeout_s=3)
    read_metadata = admin._metadata

    def then_freeze(*args):
        cluster_metadata = read_metadata(*args)
        for broker in cluster.brokers:
            os.kill(broker.service.pid(), signal.SIGSTOP)
        return cluster_metadata

    monkeypatch.setattr(admin, "_metadata", then_freeze)
    try:
        with pytest.raises(TopicError, match=r"gave no answer within 3s \(kafka.request_timeout_s\)$"):
            admin.create_topic(cfg.kafka, cfg.produce.topic, 2)
    finally:
        for broker in cluster.brokers:
            os.kill(broker.service.pid(), signal.SIGCONT)

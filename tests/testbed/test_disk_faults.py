"""A broker's log directory full on the test bed (kbit_core.testbed.disk_faults): each broker's log directory is a
small filesystem of its own (the session bed comes up with ``log_disk_mb``); filled, Kafka's next write there fails
with "No space left on device" and Kafka shuts the broker down.

One full broker during a produce loses and duplicates nothing (RF 3, min.insync.replicas=2); two full brokers make a
produce fail within its delivery timeout in one line per partition, and nothing acknowledged before is lost. The
training measurements under a full disk are tests/testbed/measure_faults.py's (docs/reliability.md).
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.config import KbitConfig
from kbit_core.errors import BrokerError
from kbit_core.kafka import contents
from kbit_core.kafka.manifest import Manifest
from kbit_core.kafka.producers import DeliveryLedger, ProducerBackend, delivery_timeout_ms, make_producer
from kbit_core.produce import produce_dataset
from kbit_core.testbed import BedState, disk_faults, faults, log_disks
from tests.conftest import unavailable
from tests.faults.test_fault_replicated import _read_indices
from tests.testbed.test_secured_kafka import bed_config

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

NO_SPACE = "No space left on device"


def test_log_filesystems_fill_free_and_unmount(tmp_path: Path):
    """Without the bed: two brokers' log directories get a 16 MiB tmpfs each; filled, nothing is free; freed, all
    but the filesystem's own use is; unmounted, they are plain directories again."""
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    brokers = [ApacheKafkaBroker(tmp_path, name=f"kafka-{i}") for i in (1, 2)]
    log_disks.mount_log_disks(brokers, 16)
    try:
        mounted = log_disks.log_disk_mounts()
        assert {b.data_dir.resolve() for b in brokers} <= set(mounted)
        assert log_disks.fill(brokers[0]) > 15 * 2**20 and log_disks.free_bytes(brokers[0]) == 0
        assert log_disks.free_bytes(brokers[1]) > 15 * 2**20, "the other broker's filesystem is its own"
        assert log_disks.free(brokers[0]) > 15 * 2**20
    finally:
        removed = log_disks.unmount_log_disks(under=tmp_path)
    assert sorted(removed) == sorted(f"log filesystem {b.data_dir.resolve()}" for b in brokers)
    assert not {b.data_dir.resolve() for b in brokers} & set(log_disks.log_disk_mounts())


@pytest.fixture
def brokers(testbed: BedState) -> faults.BedBrokers:
    bed = faults.BedBrokers.from_state(testbed)
    if not testbed.options.get("log_disk_mb"):
        unavailable("the running bed's brokers have no log filesystem of their own (`kbit cluster up --log-disk-mb`)")
    return bed


def produce_filling_a_disk(
    cfg: KbitConfig, brokers: faults.BedBrokers, fill_at: int | None
) -> tuple[Manifest, float, float, faults.FaultReport]:
    """Produce ``cfg``'s dataset; as message ``fill_at`` is sent (None: never), fill the disk of the leader of
    partition 0, and once Kafka shut that broker down free it and wait until the cluster is whole. The manifest, the
    produce's seconds, the longest wait between two sends, the fault's report (no steps without a fill)."""
    report = faults.FaultReport("fill-disk")
    victims: list[ApacheKafkaBroker] = []
    sent_at = [time.monotonic()]

    def producer_filling_the_leaders_disk(*args, **kwargs) -> ProducerBackend:
        backend = make_producer(*args, **kwargs)
        send = backend.send

        def send_then_fill(topic: str, partition: int, *rest) -> None:
            if len(sent_at) == fill_at:
                victims.append(brokers.leader_of(topic, 0)[0])
                full.enter_context(disk_faults.disks_full(brokers, victims, report))
            send(topic, partition, *rest)
            sent_at.append(time.monotonic())

        backend.send = send_then_fill  # type: ignore[method-assign]
        return backend

    with ExitStack() as full, mock.patch("kbit_core.produce.make_producer", producer_filling_the_leaders_disk):
        manifest = produce_dataset(cfg, progress=False)
        seconds = time.monotonic() - sent_at[0]
        assert fill_at is None or victims, "the produce never reached the message that fills the disk"
        disk_faults.wait_stopped(victims, faults.WHOLE_AGAIN_S)
    report.seconds = time.monotonic() - sent_at[0]
    return manifest, seconds, max(b - a for a, b in zip(sent_at, sent_at[1:])), report


def test_one_full_broker_during_a_produce_loses_and_duplicates_nothing(
    testbed: BedState, brokers: faults.BedBrokers, tmp_path: Path, record_property
):
    """The leader of partition 0's disk is filled as the producer sends message 2,000 of 4,000: Kafka shuts that
    broker down, the idempotent producer goes on with the new leader; freed and restarted, the broker catches up,
    and the topic holds every record once."""
    records = 4000
    topic = f"kbit-bed-disk-{uuid.uuid4().hex[:10]}"  # own topics: the bed outlives a session
    cfg = bed_config(
        testbed, tmp_path, f"dataset.num_records={records}", "produce.partitions=3", f"produce.topic={topic}"
    )
    manifest, seconds, longest_wait, report = produce_filling_a_disk(cfg, brokers, fill_at=2000)
    step = report.steps[0]
    assert step["shut_down_by_kafka"] and NO_SPACE in step["cause"], step
    record_property("seconds", {"produce": round(seconds, 1), "longest_send_wait": round(longest_wait, 2), **step})
    assert contents.check_topic(cfg.kafka, manifest).holds_manifest
    assert manifest.num_records == records and _read_indices(cfg, manifest) == list(range(records))


def test_two_full_brokers_fail_a_produce_in_one_line_and_lose_nothing_acknowledged(
    testbed: BedState, brokers: faults.BedBrokers, tmp_path: Path, record_property
):
    """One broker's disk full (Kafka shuts it down, the controller fences it), then a second's (neither the active
    controller, whichever broker leads the quorum): an acks=all produce
    fails within its delivery timeout (flush's deadline), in one line naming each partition; freed and restarted,
    the records acknowledged before are all there."""
    topic = f"kbit-bed-disks-{uuid.uuid4().hex[:10]}"  # own topics: the bed outlives a session
    cfg = bed_config(
        testbed, tmp_path, "dataset.num_records=500", f"produce.topic={topic}", "kafka.request_timeout_s=3"
    )
    kept = produce_dataset(cfg, progress=False)
    # the writes under the fault go to a topic of their own: the kept one must hold exactly its manifest
    scratch = produce_dataset(
        cfg.override({"produce.topic": f"{topic}-more", "dataset.num_records": 64}), progress=False
    )
    # Neither victim is the active KRaft controller: a full disk there fails its metadata log's write and ends the
    # process from the raft thread at once, and the produce would fail before the second broker went down
    controller = faults.active_controller(brokers)
    first, second = [broker for broker in brokers.cluster.brokers if broker is not controller]
    report = faults.FaultReport("fill-disk")
    producer = make_producer(cfg.kafka, cfg.produce, "none", "confluent")
    ledger = DeliveryLedger(scratch.topic, 2, cfg.kafka)
    try:
        with disk_faults.disks_full(brokers, [first, second], report):
            started = time.monotonic()
            for i in range(10):
                producer.send(scratch.topic, i % 2, b"k", b"more", ledger.callback(1, 4))
            producer.flush(delivery_timeout_ms(cfg.kafka) / 1000 + 10)
            failed_after = time.monotonic() - started
            # the replicas the message names are down: Kafka shut both brokers down before the block frees them
            disk_faults.wait_stopped([first, second], faults.WHOLE_AGAIN_S)
            with pytest.raises(BrokerError) as caught:
                ledger.raise_errors()
    finally:
        producer.close()
    message = str(caught.value)
    record_property("seconds", {"to_fail": round(failed_after, 1), "message": message, "fault": report.steps})
    assert [step["shut_down_by_kafka"] and NO_SPACE in step["cause"] for step in report.steps] == [True, True], report
    # every message failed by flush's deadline, on one line naming each partition and why: the second broker took
    # the quorum with it before the controller could take it out of the in-sync replicas, so the ledger names the
    # replica whose broker accepts no connections (docs/reliability.md)
    assert "\n" not in message and ledger.delivered_records == 0, message
    for p in (0, 1):
        assert f"{scratch.topic}[{p}]: 5 message(s) failed: its replicas on broker(s) " in message, message
        assert f"{second.node_id} ({second.host}:{second.port}) " in message, message
    assert contents.check_topic(cfg.kafka, kept).holds_manifest
    assert _read_indices(cfg, kept) == list(range(500))

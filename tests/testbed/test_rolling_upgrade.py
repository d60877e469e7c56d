"""The rolling upgrade on the test bed (kbit_core.testbed.upgrade): the session's bed re-created on the previous
Apache Kafka release (scripts/install_kafka.sh's UPGRADE_FROM, formatted with its metadata.version), a topic produced,
then every broker restarted on kbit's own release, one after the other, and the feature levels raised, while
produces run one after another throughout. Afterwards every topic reads back exact (the manifest the delivery ledger
wrote matches the brokers' offsets, every record once) and the cluster reports the new release's metadata.version.

The upgraded bed is the session's bed again (kbit's release, the session's options), so the bed tests after this one
use it as they would have. The training measurements under the upgrade are tests/testbed/measure_faults.py's.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kbit_core import testbed as bed
from kbit_core.brokers.kafka_release import installed_kafka_versions, kafka_version
from kbit_core.config import KbitConfig
from kbit_core.kafka import contents
from kbit_core.kafka.manifest import Manifest
from kbit_core.produce import produce_dataset
from kbit_core.testbed import BedOptions, BedState, faults, upgrade
from tests.conftest import unavailable
from tests.faults.test_fault_replicated import _read_indices
from tests.testbed.conftest import bring_up, started_by_this_session
from tests.testbed.test_secured_kafka import bed_config

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

RECORDS = 200


@pytest.fixture
def older_bed(testbed: BedState):
    """The session's bed, re-created on the previous Apache Kafka release; afterwards on kbit's release again (the
    upgrade leaves it so; a failed one is re-created)."""
    older = [v for v in installed_kafka_versions() if v != kafka_version()]
    if not older:
        unavailable("no previous Apache Kafka release is installed (`bash scripts/run.sh install` installs it)")
    if not started_by_this_session(testbed):
        unavailable("the bed that is up was not started by this session; re-creating it would drop its topics")
    options = BedOptions(**testbed.options)
    bed.down(testbed.bed_dir)
    try:
        yield bring_up(testbed.bed_dir, replace(options, kafka_version=older[-1]))
    finally:
        now = bed.load_state(testbed.bed_dir)
        if now is None or now.options["kafka_version"] is not None or not bed.status(testbed.bed_dir).up:
            bed.down(testbed.bed_dir)
            bring_up(testbed.bed_dir, options)


def _produce(state: BedState, workdir: Path, topic: str) -> tuple[Manifest, KbitConfig]:
    cfg = bed_config(state, workdir, f"dataset.num_records={RECORDS}", f"produce.topic={topic}")
    return produce_dataset(cfg, progress=False), cfg


def test_a_rolling_upgrade_with_produces_throughout_loses_nothing_and_finalizes_the_new_release(
    older_bed: BedState, tmp_path: Path, record_property
):
    older, target = older_bed.options["kafka_version"], kafka_version()
    brokers = faults.BedBrokers.from_state(older_bed)
    assert {upgrade.running_release(b) for b in brokers.cluster.brokers} == {older}
    before = [b.service.pid() for b in brokers.cluster.brokers]
    name = f"kbit-bed-upgrade-{tmp_path.name[-8:]}"
    produced = [_produce(older_bed, tmp_path, name)]

    upgraded = threading.Event()
    failures: list[str] = []
    refused: list[str] = []  # topics the cluster would not create while a broker was down

    def keep_producing() -> None:  # one small topic after another until the upgrade is done
        while not upgraded.is_set() and not failures:
            topic = f"{name}-{len(produced) + len(refused)}"
            try:
                produced.append(_produce(older_bed, tmp_path, topic))
            except BaseException as exc:  # the test fails with it below
                # A topic of replication factor 3 cannot be created while a broker is down (Kafka refuses it); the
                # produce fails before sending anything, in one line. Any other failure fails the test.
                (refused if str(exc).startswith(f"cannot create topic '{topic}'") else failures).append(str(exc))

    producer = threading.Thread(target=keep_producing, daemon=True)
    producer.start()
    try:
        report = upgrade.rolling_upgrade(older_bed.bed_dir)
    finally:
        upgraded.set()
        producer.join(timeout=600)
    assert not failures, f"a produce during the upgrade failed: {failures[0]}"
    record_property("seconds", round(report.seconds, 1))
    record_property("produces", len(produced))
    record_property("topics_refused", len(refused))

    steps, features = report.steps[:-1], report.steps[-1]
    assert [s["broker"] for s in steps] == [b.service.name for b in brokers.cluster.brokers]
    assert all(s["release"] == f"{older} -> {target}" for s in steps), steps
    after = [b.service.pid() for b in brokers.cluster.brokers]
    assert all(a is not None and a != b for a, b in zip(after, before)), (before, after)
    assert {upgrade.running_release(b) for b in brokers.cluster.brokers} == {target}
    # the older release formatted the cluster with its own metadata.version; the new one is read back from the cluster
    assert features["features_before"]["metadata.version"].startswith(upgrade.release_of(older) + "-IV")
    finalized = upgrade.FeatureTool.of_bed(brokers, older_bed.bed_dir, target).finalized()["metadata.version"]
    assert finalized == features["features_after"]["metadata.version"]
    assert finalized.startswith(upgrade.release_of(target) + "-IV")
    assert bed.load_state(older_bed.bed_dir).options["kafka_version"] is None
    for manifest, cfg in produced:
        assert contents.check_topic(cfg.kafka, manifest).holds_manifest, manifest.topic
        assert _read_indices(cfg, manifest) == list(range(RECORDS)), manifest.topic

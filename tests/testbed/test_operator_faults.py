"""Operators' faults on the test bed's Kafka (kbit_core.testbed.faults), on delayed links: a rolling restart, the
leader of a partition cut off by nftables while it runs, the active KRaft controller killed. After each the cluster
is whole again and a topic produced before reads back exact with both Kafka clients (confluent-kafka and
kafka-python): every record once, the manifest matching the offsets.

One bed for all three and one small topic; every broker restarts on delayed links (their start-up used to fail
there). The training measurements under these faults are tests/testbed/measure_faults.py's (docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kbit_core import testbed as bed
from kbit_core.kafka import contents
from kbit_core.produce import produce_dataset
from kbit_core.testbed import BedState, faults
from tests.faults.test_fault_replicated import _read_indices
from tests.testbed.conftest import links_restored
from tests.testbed.test_secured_kafka import bed_config

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

RECORDS = 500
DELAYED = "10gbit,0.2ms"
# The cut-off lasts this long and until the controller fenced the broker (its 9 s session timed out; a cut-off active
# controller is first replaced, 2 s later): whatever the machine's load, the test sees a fenced broker come back.
CUT_OFF_S = 5


@pytest.fixture
def delayed(testbed: BedState):
    """The bed on delayed links; its links as they were after the test."""
    with links_restored(testbed, "the bed's faults"):
        bed.reshape(testbed.bed_dir, DELAYED)
        yield testbed


def _pids(brokers: faults.BedBrokers) -> list[int | None]:
    return [b.service.pid() for b in brokers.cluster.brokers]


def test_a_rolling_restart_a_cut_off_leader_and_a_killed_controller_leave_the_topic_exact(
    delayed: BedState, tmp_path: Path, record_property
):
    topic = f"kbit-bed-ops-{tmp_path.name[-8:]}"
    cfg = bed_config(delayed, tmp_path, f"dataset.num_records={RECORDS}", f"produce.topic={topic}")
    manifest = produce_dataset(cfg, progress=False)
    brokers = faults.BedBrokers.from_state(delayed)
    seconds = {}

    before = _pids(brokers)
    restart = faults.rolling_restart(brokers)
    after = _pids(brokers)
    assert [s["broker"] for s in restart.steps] == [b.service.name for b in brokers.cluster.brokers]
    assert all(a is not None and a != b for a, b in zip(after, before)), (before, after)
    seconds["rolling_restart"] = round(restart.seconds, 1)

    victim, host = brokers.leader_of(manifest.topic, 0)
    cut = faults.cut_off(brokers, victim, host, seconds=CUT_OFF_S, until_fenced=True)
    assert _pids(brokers) == after, "a cut-off broker keeps running"
    assert cut.steps[0]["fenced_after_s"] is not None, f"the controller never fenced the cut-off broker: {cut.steps}"
    seconds["cut_off_until_fenced"] = round(cut.seconds, 1)

    killed = faults.active_controller(brokers)
    kill = faults.kill_controller(brokers)
    assert kill.steps[0]["broker"] == killed.service.name and kill.steps[0]["new_leader"] != killed.service.name
    seconds["kill_controller"] = round(kill.seconds, 1)
    record_property("seconds", seconds)

    assert contents.check_topic(cfg.kafka, manifest).holds_manifest
    for client in ("confluent", "kafka-python"):  # both of kbit's readers, on the cluster the faults left
        assert _read_indices(cfg.override({"kafka.client": client}), manifest) == list(range(RECORDS)), client

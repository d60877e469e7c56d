"""Continuous training with kbit's live producer writing, on the bed's three brokers, through an operator's fault: the
active KRaft controller killed while the producer appends and the ranks train. Every record the producer had
acknowledged is trained exactly once (the stream ledger's audit), and the job does not fail or restart.

The cheapest of the faults (the measurements of all of them are tests/testbed/measure_faults.py --stream's, in
docs/reliability.md); small: 640 records, steps of at least 0.5 s so that the fault falls inside the training.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kbit_core.testbed import BedState, faults
from tests.testbed.stream_workload import run_stream

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

RECORDS = 640  # 20 steps of the 32-record global batch


def test_continuous_training_trains_every_acknowledged_record_once_through_a_killed_controller(
    testbed: BedState, tmp_path: Path, record_property
):
    brokers = faults.BedBrokers.from_state(testbed)
    row = run_stream(
        testbed,
        tmp_path / "stream",
        RECORDS,
        rate=40,
        step_s=0.5,
        at_step=3,
        fire=lambda topic: faults.kill_controller(brokers),
    )
    record_property("seconds", row["seconds"])
    assert row["rc"] == 0, row.get("stderr")
    assert row["fault"] is not None, "the job ended before the fault fired"
    assert row["fault"]["steps"][0]["new_leader"] != row["fault"]["steps"][0]["broker"]
    assert (row["restarts"], row["stop_reason"]) == (0, "records")
    assert row["exactly_once"], row["audit"]
    assert row["acknowledged"] == row["trained"] == RECORDS

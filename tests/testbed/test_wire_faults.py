"""Faults on the wire of the test bed: 1 % packet loss on every link for a whole epoch, and on top of it a node's
link dropped for 10 s mid-epoch. The readers retry and the run ends with the weights of a run on clean links
(torch.equal).

Both runs train the train-cluster profile (DDP, one rank per node host, TLS and SCRAM to the three brokers) on
1000 records for one epoch; the two faults share one run to keep the suite's time (docs/reliability.md has each
fault's time measured alone).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kbit_core import testbed as bed
from kbit_core.testbed import BedState
from kbit_core.train import checkpoint as ckpt
from tests.conftest import FAULT_MODELS_DIR, REPO
from tests.integration.fault_models import OUTAGE_TABLE
from tests.testbed.conftest import links_restored
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, assert_ranks_on_node_hosts, bed_sets, run_kbit

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.kafka]

OUTAGE_S = 10.0


@pytest.fixture
def wire(testbed: BedState):
    """The bed with nft available; its links as they were after the test (shape and any outage table removed)."""
    with links_restored(testbed, "faults on the wire"):
        yield testbed
    for node in testbed.nodes:
        nft = ["ip", "netns", "exec", str(node.netns), "nft", "delete", "table", "netdev", OUTAGE_TABLE]
        subprocess.run(nft, capture_output=True)


def _train(testbed: BedState, workdir: Path, topic: str, at_step: int, marker: Path) -> tuple[dict, float]:
    model = {
        "name": "fault_models:drop_link_once",
        "kwargs": {"at_step": at_step, "seconds": OUTAGE_S, "marker": str(marker)},
    }
    extra = {
        "dataset.num_records": 1000,
        "train.epochs": 1,
        "tracking.enabled": False,
        "train.model": model,
        "launch.spark_conf": {"spark.executorEnv.PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
    }
    sets = bed_sets(testbed, workdir, **extra)
    # one topic for both runs: every run reads the same records (the data's own first production is off-clock)
    sets += ["--set", f"produce.topic={topic}"]
    started = time.monotonic()
    done = run_kbit(
        "train", "--config", str(TRAIN_CLUSTER), "--json", *sets, env={"PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"}
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert_ranks_on_node_hosts(result, testbed)
    assert result["data"]["train"]["skipped_messages"] == 0 and result["data"]["train"]["gaps"] == 0
    return result, seconds


def _weights(result: dict) -> dict[str, torch.Tensor]:
    return ckpt.read_file(Path(result["checkpoint"]))[ckpt.MODEL]


def test_loss_and_a_dropped_link_leave_the_weights_of_a_clean_run(
    wire: BedState, tmp_path: Path, record_property
) -> None:
    topic = f"kbit-bed-wire-{tmp_path.name[-8:]}"
    clean, clean_s = _train(wire, tmp_path / "clean", topic, at_step=0, marker=tmp_path / "never")
    bed.reshape(wire.bed_dir, "10gbit,0ms,1%")
    marker = tmp_path / "outage"
    faulted, faulted_s = _train(wire, tmp_path / "faulted", topic, at_step=5, marker=marker)
    down, up = (float(t) for t in marker.read_text().split())
    record_property("seconds", {"clean": round(clean_s, 1), "loss_1pct_and_outage_10s": round(faulted_s, 1)})
    assert up - down >= OUTAGE_S
    reference, weights = _weights(clean), _weights(faulted)
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    assert faulted["loss_curve"] == clean["loss_curve"]

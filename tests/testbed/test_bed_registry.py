"""The test bed's Schema Registry on the driver host: a user's producer on a node host registers its schema there and
writes Avro through confluent-kafka's AvroSerializer to the bed's brokers (TLS, SCRAM); kbit reads the topic back
through the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from kbit_core import testbed as bed
from kbit_core.config import load_config
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.kafka.settings import confluent_options
from kbit_core.testbed import BedState
from kbit_core.testbed.network import Host, in_host
from kbit_core.topic_dataset import snapshot_dataset
from tests.conftest import require_schema_registry

PRODUCER = Path(__file__).with_name("node_avro_producer.py")
RECORDS = 40


@pytest.fixture
def bed_registry(testbed: BedState) -> Iterator[BedState]:
    """The session's bed with its Schema Registry; stopped again afterwards when the bed came up without one."""
    require_schema_registry()
    before = bed.state_path(testbed.bed_dir).read_text()
    state = bed.start_registry(testbed.bed_dir)
    yield state
    if bed.load_state(testbed.bed_dir).registry_url != testbed.registry_url:
        bed.stop_registry(testbed.bed_dir)
        bed.state_path(testbed.bed_dir).write_text(before)  # as the session's bed was, whoever brought it up


def test_a_node_hosts_avro_producer_registers_at_the_beds_registry_and_kbit_reads_it_back(
    bed_registry: BedState, tmp_path: Path
) -> None:
    state = bed_registry
    assert state.registry_url == f"http://{state.driver.address}:{state.options['registry_port']}/apis/ccompat/v7"
    shown = bed.status(state.bed_dir)
    assert shown.up and shown.to_dict()["state"]["registry_url"] == state.registry_url
    assert [p.host for p in shown.processes if p.name == "schema-registry"] == [state.driver.name]
    print(f"the bed's Schema Registry started in {state.registry_up_s} s")
    topic = f"kbit-user-avro-{tmp_path.name}"[:100]  # the training user may use topics named kbit* (its ACLs)
    node = state.nodes[0]
    proc = subprocess.run(
        in_host(
            Host(node.name, node.address, node.netns),
            [sys.executable, str(PRODUCER), str(bed.state_path(state.bed_dir)), topic, str(RECORDS)],
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert written["hostname"] == node.name and written["written"] == RECORDS
    overrides = {**state.kafka_overrides(), **state.registry_overrides()}
    cfg = load_config(
        None, [f"workdir={tmp_path}", "tracking.enabled=false", *(f"{k}={v}" for k, v in overrides.items())]
    )
    mapping = {"features": ["levels"], "shape": [1, 1, 4], "dtype": "float32", "label": "alarm", "num_classes": 2}
    cfg = cfg.override(
        {
            "source": {"topic": topic, "value_format": "confluent-avro", "mapping": mapping},
            "shard.split_rates": [1.0],
            "train.global_batch_size": 8,
        }
    )
    try:
        manifest = snapshot_dataset(cfg)  # the mapping checked against the writer schema the registry holds
        assert manifest.num_records == RECORDS
        loader = make_split_loader(cfg, manifest, "train", 0, 1)
        got = {
            int(i): (float(x[0, 0, 0]), int(y))
            for batch in loader.iter_indexed()
            for i, x, y in zip(batch.indices, batch.x, batch.y)
        }
    finally:
        admin = AdminClient(confluent_options(cfg.kafka))  # held while its future waits
        admin.delete_topics([topic])[topic].result(60)  # the test's own topic
    # record n went to partition n % 2 at offset n // 2: snapshot index (n % 2) * 20 + n // 2
    assert got == {(n % 2) * (RECORDS // 2) + n // 2: (pytest.approx(n / 10), n % 2) for n in range(RECORDS)}

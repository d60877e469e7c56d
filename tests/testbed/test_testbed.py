"""The multi-host test bed for real: Spark workers on two namespaced hosts, a broker on every host over TLS and
SCRAM, teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kbit_core import testbed as bed
from kbit_core.testbed import BedOptions, BedState, TestbedError
from kbit_core.testbed.network import Host, in_host
from kbit_core.testbed.spark_standalone import master_json

ROUNDTRIP = Path(__file__).with_name("node_roundtrip.py")
KBIT = Path(sys.executable).with_name("kbit")


def _node(state: BedState, index: int) -> Host:
    n = state.nodes[index]
    return Host(n.name, n.address, n.netns)


def _run_on(state: BedState, index: int, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(in_host(_node(state, index), argv), capture_output=True, text=True, timeout=timeout_s)


def _overrides(state: BedState, *, drop: tuple[str, ...] = ()) -> list[str]:
    return [f"{k}={v}" for k, v in state.kafka_overrides().items() if k not in drop]


def test_master_sees_a_worker_alive_on_each_node_host(testbed: BedState):
    page = master_json(testbed.driver.address, testbed.options["master_webui_port"])
    assert page is not None and page["status"] == "ALIVE"
    alive = {w["host"] for w in page["workers"] if w["state"] == "ALIVE"}
    assert alive == {n.address for n in testbed.nodes}
    assert testbed.master_url == f"spark://{testbed.driver.address}:{testbed.options['master_port']}"


def test_each_node_runs_under_its_own_hostname_and_status_reports_it(testbed: BedState):
    st = bed.status(testbed.bed_dir)
    assert st.up
    by_name = {p.name: p for p in st.processes}
    for node in testbed.nodes:
        worker = by_name[f"spark-worker-{node.name}"]
        assert worker.alive and worker.hostname == node.name and worker.address == node.address
        assert Path(worker.log).is_file()
    assert by_name["spark-master"].hostname == os.uname().nodename  # the driver host is the machine itself
    assert (
        _run_on(testbed, 1, [sys.executable, "-c", "import socket; print(socket.gethostname())"]).stdout.strip()
        == testbed.nodes[1].name
    )


def test_status_command_prints_the_state_as_json(testbed: BedState):
    proc = subprocess.run(
        [str(KBIT), "cluster", "status", "--json", "--set", f"workdir={testbed.bed_dir.parent}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["up"] and out["state"]["broker_bootstrap"] == testbed.broker_bootstrap
    assert sorted(out["alive_workers"]) == sorted(n.address for n in testbed.nodes)


def test_up_again_returns_the_running_bed_unchanged(testbed: BedState):
    pids = {p.name: p.pid for p in bed.status(testbed.bed_dir).processes}
    # the bed as it runs now (test_rolling_upgrade re-creates the session's bed: new PIDs, not the fixture's)
    running = bed.load_state(testbed.bed_dir)
    assert bed.up(testbed.bed_dir, BedOptions(**testbed.options)) == running
    assert {p.name: p.pid for p in bed.status(testbed.bed_dir).processes} == pids


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_node_produces_and_reads_over_mutual_tls(testbed: BedState, tmp_path: Path, client: str):
    proc = _run_on(testbed, 0, [sys.executable, str(ROUNDTRIP), client, str(tmp_path), *_overrides(testbed)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "hostname": testbed.nodes[0].name,
        "produced": 64,
        "read": {"confluent": 64, "kafka-python": 64, "batches": 64},
    }


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        (("kafka.ssl_cafile",), "kafka.ssl_cafile"),
        (("kafka.ssl_certfile", "kafka.ssl_keyfile"), "kafka.ssl_certfile"),
    ],
)
def test_the_broker_refuses_a_node_without_the_ca_or_a_client_certificate(
    testbed: BedState, tmp_path: Path, dropped: tuple[str, ...], named: str
):
    proc = _run_on(
        testbed,
        1,
        [sys.executable, str(ROUNDTRIP), "confluent", str(tmp_path), *_overrides(testbed, drop=dropped)],
        timeout_s=60,
    )
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr[-3000:]


def test_a_broker_runs_on_every_host_and_speaks_only_tls(testbed: BedState):
    """Every host runs one broker (under its own hostname); a plaintext Kafka request to any of its ports, from a node,
    gets no answer: the brokers terminate TLS on every listener (client, inter-broker, controller)."""
    by_name = {p.name: p for p in bed.status(testbed.bed_dir).processes}
    for host in (testbed.driver, *testbed.nodes):
        assert by_name[f"kafka-{host.name}"].alive and by_name[f"kafka-{host.name}"].address == host.address
    assert by_name["kafka-node1"].hostname == "node1"
    assert testbed.broker_bootstrap == ",".join(f"{h.address}:19093" for h in (testbed.driver, *testbed.nodes))
    ports = [testbed.options[k] for k in ("broker_port", "broker_internal_port", "broker_controller_port")]
    probe = (
        "import struct\nfrom kbit_core.brokers.apache_broker import metadata_brokers\n"
        f"for port in {ports}:\n    try:\n        print(metadata_brokers('{testbed.driver.address}', port))\n"
        "    except (OSError, struct.error):\n        print('refused')"
    )
    assert _run_on(testbed, 0, [sys.executable, "-c", probe]).stdout.split() == ["refused"] * 3


def test_require_bed_for_refuses_bed_addresses_while_their_bed_is_down(testbed: BedState):
    bed.require_bed_for([testbed.master_url, testbed.broker_bootstrap, "127.0.0.1:9092", None])
    with pytest.raises(TestbedError, match="kbit cluster up"):
        bed.require_bed_for(["spark://10.213.9.1:7077"], subnet="10.213.9.0/24")


def _bed_leftovers(bed_dir: Path) -> dict[str, list[str]]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return {
        "netns": bed.network.bed_namespaces(),
        "links": [line for line in links.splitlines() if "kbit-" in line],
        "processes": [
            line for line in ps.splitlines() if f"{bed_dir}/run/" in line or "org.apache.spark.deploy." in line
        ],
        # Ray's node processes (GCS, raylet, agents, workers) outlive a killed `ray start`; all carry the marker
        "marked": [str(d) for d in [bed.running_bed_dir()] if d is not None],
        # the brokers' logs and the SCRAM passwords go with the bed
        "files": [str(p) for p in (bed_dir / "run", bed_dir / "credentials") if p.exists()],
    }


@pytest.mark.slow
def test_down_cleans_up_after_a_crash_and_up_recovers(testbed: BedState):
    """Kill every bed process and delete the state file (a crash), then `down` must still remove everything.

    Runs last in this module and brings the bed back up for whatever uses it afterwards.
    """
    for p in bed.status(testbed.bed_dir).processes:
        if p.pid:
            os.kill(p.pid, signal.SIGKILL)
    bed.state_path(testbed.bed_dir).unlink()
    assert not bed.status(testbed.bed_dir).up
    removed = bed.down(testbed.bed_dir)
    assert any(r.startswith("netns") for r in removed)
    assert _bed_leftovers(testbed.bed_dir) == {"netns": [], "links": [], "processes": [], "marked": [], "files": []}
    assert bed.down(testbed.bed_dir) == []  # idempotent: nothing left, nothing to do
    restored = bed.up(testbed.bed_dir, BedOptions(**testbed.options))
    assert restored.broker_bootstrap == testbed.broker_bootstrap and bed.status(testbed.bed_dir).up


def test_bed_up_refuses_what_the_machine_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(bed.network.shutil, "which", lambda tool: None)
    with pytest.raises(TestbedError, match="the `ip` command"):
        bed.up(tmp_path)

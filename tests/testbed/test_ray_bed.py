"""Ray on the test bed for real: a Ray node on each node host (none on the driver host), its sockets only on the bed's
network, and a Ray Train launch from the driver host (through Ray Client) whose ranks run on the node hosts and read
the broker over mutual TLS."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest

from kbit_core import testbed as bed
from kbit_core.testbed import BedState
from tests.conftest import unavailable
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, assert_trained_on_node_hosts, bed_sets, run_kbit

pytestmark = [pytest.mark.ray]


@pytest.fixture
def ray_bed(testbed: BedState) -> BedState:
    pytest.importorskip("ray")
    if testbed.ray_address is None:
        unavailable("this test bed came up without Ray (the `ray` extra was missing then)")
    return testbed


def _ray_processes(state: BedState) -> dict[str, list[int]]:
    """PID trees (the `ray start` process, GCS, raylet, agents, workers) of the bed's Ray nodes, by service name."""
    trees = {}
    for p in bed.status(state.bed_dir).processes:
        if p.name.startswith("ray-") and p.pid is not None:
            root = psutil.Process(p.pid)
            trees[p.name] = [root.pid, *(c.pid for c in root.children(recursive=True))]
    return trees


def _listening_pids(netns: str | None) -> set[int]:
    argv = ["ss", "-ltnpH"] if netns is None else ["ip", "netns", "exec", netns, "ss", "-ltnpH"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {
        int(part.split("=", 1)[1])
        for part in out.replace(",", " ").replace(")", " ").split()
        if part.startswith("pid=")
    }


def test_a_ray_node_runs_on_each_node_host_and_listens_only_on_the_bed(ray_bed: BedState):
    st = bed.status(ray_bed.bed_dir)
    assert st.up and sorted(st.ray_nodes) == sorted(n.address for n in ray_bed.nodes)
    by_name = {p.name: p for p in st.processes}
    head, *workers = ray_bed.nodes
    assert ray_bed.ray_address == f"ray://{head.address}:{ray_bed.options['ray_client_port']}"
    for name, node in [(f"ray-head-{head.name}", head), *((f"ray-worker-{n.name}", n) for n in workers)]:
        assert by_name[name].alive and by_name[name].hostname == node.name, by_name[name]
    trees = _ray_processes(ray_bed)
    assert set(trees) == {f"ray-head-{head.name}", *(f"ray-worker-{n.name}" for n in workers)}
    ray_pids = {pid for tree in trees.values() for pid in tree}
    # Ray's gRPC servers bind every interface of their network namespace: none of them may sit in the driver's
    assert _listening_pids(None) & ray_pids == set()
    assert _listening_pids(head.netns) & ray_pids, "the Ray head listens nowhere on its host"
    for node in ray_bed.nodes:  # and a node's namespace has loopback and its link to the bed's bridge, nothing else
        out = subprocess.run(["ip", "-n", node.netns, "-o", "addr"], capture_output=True, text=True, check=True)
        addresses = [line.split()[1:4] for line in out.stdout.splitlines()]  # [interface, family, address/prefix]
        assert {interface for interface, _, _ in addresses} == {"lo", "eth0"}, addresses
        assert [a.split("/")[0] for i, family, a in addresses if (i, family) == ("eth0", "inet")] == [node.address]


@pytest.mark.slow
@pytest.mark.kafka
def test_ray_train_ranks_run_on_the_node_hosts_and_read_the_broker_over_tls(ray_bed: BedState, tmp_path: Path):
    workdir = tmp_path / "train-ray-cluster"
    done = run_kbit(
        "train",
        "--config",
        str(TRAIN_CLUSTER),
        "--json",
        *bed_sets(ray_bed, workdir, **ray_bed.ray_overrides()),
        env={"RAY_AUTH_MODE": "token"},
    )  # the bed's Ray asks every client for the cluster's token
    assert_trained_on_node_hosts(done, ray_bed, workdir)

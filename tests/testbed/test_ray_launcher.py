"""Ray's own cluster launcher on the bed, as a team runs it: `ray up` over SSH with deployments/ray/cluster.yaml (head
on node1, node2 a worker the autoscaler starts on demand), a Ray Train run through `launch.ray_address` whose ranks
need that worker, a Ray Tune sweep through the same address, `ray exec`, the idle worker removed again, and `ray down` (with the worker host's own `ray stop`)
leaving none of its Ray processes while the bed's own Ray nodes on the same hosts run on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kbit_core import ray_env
from kbit_core import testbed as bed
from kbit_core.testbed import BedState, ray_cluster, ray_launcher, ssh_hosts
from kbit_core.testbed.marked import MARKER_ENV
from tests.conftest import unavailable
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, assert_ranks_on_node_hosts, bed_sets, run_kbit

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.kafka]

RAY = str(Path(sys.executable).parent / "ray")
HEAD_PORT, CLIENT_PORT = 6390, 6391  # deployments/ray/cluster.yaml's
DEADLINE_S = 600.0  # generous: the autoscaler's idle timeout is 1 minute, each step takes seconds on an idle machine
POLL_S = 5.0  # each poll starts a Python that imports Ray: seconds of CPU on a 2-core machine
TUNE_SPACE = {"train.optim.lr": [3e-3, 1e-6]}  # 1e-6 barely moves the weights in one epoch: trial 0 is the best
PRINT_NODES = (
    'python -c \'import json, ray; ray.init(address="auto", log_to_driver=False); '
    'print(json.dumps({n["NodeManagerAddress"]: n["Alive"] for n in ray.nodes()}))\''
)


@pytest.fixture
def launcher_bed(testbed: BedState) -> BedState:
    pytest.importorskip("ray")
    missing = ssh_hosts.missing_prerequisites()
    if missing or testbed.ray_cluster_yaml is None:
        unavailable("Ray's cluster launcher on the bed needs " + ("; ".join(missing) or "a bed brought up with sshd"))
    return testbed


def _ray(state: BedState, *args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [RAY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **ray_launcher.launcher_env(state.bed_dir)},
    )
    assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _launched_processes(state: BedState) -> list[psutil.Process]:
    """Ray processes started over the node hosts' sshd (the launcher's cluster), on any host."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(ssh_hosts.HOST_VARIABLE) and "ray" in " ".join(proc.info["cmdline"] or []).lower():
            if env.get(MARKER_ENV) == str(state.bed_dir):
                found.append(proc)
    return found


def _names(state: BedState, host: str) -> list[str]:
    names = []
    for proc in _launched_processes(state):
        try:
            if proc.environ().get(ssh_hosts.HOST_VARIABLE) == host:
                names.append(" ".join(proc.cmdline())[:80])
        except psutil.Error:
            continue
    return names


def _ssh_ray_stop(state: BedState, address: str) -> None:
    """`ray stop` on the host at ``address``, over its sshd with kbit's key, in the login shell Ray's launcher uses."""
    key = ssh_hosts.client_key(state.bed_dir)
    options = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes"]
    done = subprocess.run(
        [
            "ssh",
            "-i",
            str(key),
            *options,
            f"{ssh_hosts.SSH_USER}@{address}",
            "bash --login -c -i 'source ~/.bashrc; ray stop'",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _alive(state: BedState) -> set[str]:
    token = ray_env.own_token_file(state.bed_dir)
    return set(ray_cluster.alive_nodes(f"{state.nodes[0].address}:{HEAD_PORT}", token))


def _wait_for(condition, what: str, timeout_s: float = DEADLINE_S) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(POLL_S)
    return time.monotonic() - started


class _JoinWatch(threading.Thread):
    """When (seconds after start) the worker host's Ray node joined the launcher's cluster."""

    def __init__(self, state: BedState, address: str) -> None:
        super().__init__(daemon=True)
        self.state, self.address, self.started = state, address, time.monotonic()
        self.joined_after_s: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and self.joined_after_s is None:
            if self.address in _alive(self.state):
                self.joined_after_s = round(time.monotonic() - self.started, 1)
            self.done.wait(POLL_S)


def _launcher_cluster(state: BedState) -> dict[str, Any]:
    """Settings for a run of two ranks (one CPU each) on the launcher's cluster, small data, one epoch."""
    return {
        "launch.engine": "ray",
        "launch.ray_address": f"ray://{state.nodes[0].address}:{CLIENT_PORT}",
        "launch.ray_auth_token_file": str(ray_env.own_token_file(state.bed_dir)),
        "launch.num_processes": 2,
        "dataset.num_records": 2000,
        "train.epochs": 1,
        "train.model": {"name": "mlp"},
        "tracking.enabled": False,
    }  # the launcher's Ray asks every client for the cluster's token, as the bed's own does


def _train(state: BedState, workdir: Path) -> subprocess.CompletedProcess[str]:
    sets = bed_sets(state, workdir, **_launcher_cluster(state))
    return run_kbit("train", "--config", str(TRAIN_CLUSTER), "--json", *sets, timeout=DEADLINE_S)


def _tune_sweep(state: BedState, workdir: Path) -> dict[str, Any]:
    """kbit's Ray Tune sweep (two trials: a good and a useless learning rate) on the launcher's cluster; its result."""
    sets = [arg for arg in bed_sets(state, workdir, **_launcher_cluster(state)) if arg != "--set"]
    out = workdir / "sweep.json"
    script = (
        "import json, sys; from pathlib import Path; from kbit_core.config import load_config; "
        "from kbit_core.jobs.sweep import tune_sweep; "
        "cfg = load_config(Path(sys.argv[1]), sys.argv[3:]); "
        f"Path(sys.argv[2]).write_text(json.dumps(tune_sweep(cfg, space={TUNE_SPACE!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(TRAIN_CLUSTER), str(out), *sets],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture
def launched(launcher_bed: BedState, record_property) -> Iterator[str]:
    """`ray up` with the bed's cluster.yaml (its path); afterwards `ray down`, if the test left the cluster up."""
    cluster_yaml = str(launcher_bed.ray_cluster_yaml)
    started = time.monotonic()
    _ray(launcher_bed, "up", "-y", "--no-config-cache", cluster_yaml)
    record_property("ray_up_s", round(time.monotonic() - started, 1))
    yield cluster_yaml
    if _launched_processes(launcher_bed):
        subprocess.run(
            [RAY, "down", "-y", cluster_yaml],
            capture_output=True,
            timeout=DEADLINE_S,
            env={**os.environ, **ray_launcher.launcher_env(launcher_bed.bed_dir)},
        )


@pytest.mark.timeout(3 * DEADLINE_S)  # about 4 minutes on an idle machine; each step has its own generous deadline
def test_ray_up_autoscales_a_worker_for_a_train_run_and_ray_down_leaves_none(
    launcher_bed: BedState, launched: str, tmp_path: Path, record_property
) -> None:
    state, cluster_yaml = launcher_bed, launched
    head, worker = launcher_bed.nodes[0], launcher_bed.nodes[1]
    assert _alive(state) == {head.address}  # min_workers 0: the head only, one CPU

    watch = _JoinWatch(state, worker.address)
    watch.start()
    started = time.monotonic()
    done = _train(state, tmp_path / "train")  # two ranks of one CPU each: the head holds one
    watch.done.set()
    record_property("train_s", round(time.monotonic() - started, 1))
    record_property("worker_joined_after_s", watch.joined_after_s)
    assert done.returncode == 0, done.stderr[-4000:]
    assert_ranks_on_node_hosts(json.loads(done.stdout), state)  # one rank on node1 (head), one on node2 (autoscaled)

    started = time.monotonic()
    swept = _tune_sweep(state, tmp_path / "sweep")  # while the worker is still up: within its idle timeout
    record_property("tune_sweep_s", round(time.monotonic() - started, 1))
    assert [t["params"] for t in swept["trials"]] == [{"train.optim.lr": lr} for lr in TUNE_SPACE["train.optim.lr"]]
    for trial in swept["trials"]:
        assert trial["epochs"] == 1
        assert_ranks_on_node_hosts(trial, state)  # each trial's two ranks: node1 and node2 of the launcher's cluster
    assert swept["best"]["trial"] == 0, swept["trials"]

    printed = _ray(state, "exec", cluster_yaml, PRINT_NODES).stdout.splitlines()
    nodes = json.loads([line for line in printed if line.startswith("{")][-1])
    assert nodes[head.address] is True and worker.address in nodes, nodes

    removed_after = _wait_for(lambda: worker.address not in _alive(state), "the idle worker removed")
    record_property("idle_worker_removed_after_s", round(removed_after, 1))
    record_property("left_on_worker_after_removal", sorted(_names(state, worker.name)))

    _ray(state, "down", "-y", cluster_yaml)
    _wait_for(lambda: not _names(state, head.name), "every Ray process of the launcher's cluster gone from the head")
    # `ray down` on the local provider runs `ray stop` on the head only, and a drained worker's log_monitor.py outlives
    # its raylet: what a worker host keeps, an operator stops there (the host's own `ray stop`)
    record_property("left_on_worker_after_ray_down", sorted(_names(state, worker.name)))
    _ssh_ray_stop(state, worker.address)
    _wait_for(lambda: not _launched_processes(state), "every Ray process of the launcher's cluster gone")
    # `ray down` ran `ray stop` on node1, where the bed's own Ray head runs too: the host's own stop spared it
    assert set(bed.status(state.bed_dir).ray_nodes) >= {n.address for n in state.nodes}

"""Training and the benchmark across hosts, for real: the `kbit` command on the driver host of the test bed, ranks on
the node hosts through the Spark standalone master (local_mode false), data read over TLS from the broker."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kbit_core.testbed import BedState
from tests.conftest import FAULT_MODELS_DIR, REPO, processes_mentioning

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.kafka]

KBIT = Path(sys.executable).parent / "kbit"
TRAIN_CLUSTER = REPO / "deployments" / "train-cluster.yaml"
BENCH_CLUSTER = REPO / "deployments" / "bench-cluster.yaml"


def bed_sets(testbed: BedState, workdir: Path, **extra: Any) -> list[str]:
    """--set arguments that point a cluster profile at this bed (its own certificate paths), fresh topics and a fresh
    workdir."""
    # The bed's broker outlives one test (and a bed left up by `kbit cluster up` outlives the session): own topics.
    unique = uuid.uuid4().hex[:10]
    values = {
        **testbed.kafka_overrides(),
        "produce.topic": f"kbit-bed-{unique}",
        "produce.topic_prefix": f"kbit-bed-{unique}",
        "launch.master": testbed.master_url,
        "launch.driver_host": testbed.driver.address,
        "launch.driver_bind_address": testbed.driver.address,
        "workdir": str(workdir),
        "tracking.tracking_uri": f"sqlite:///{workdir}/mlflow.db",
        **extra,
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={_yaml(value)}")]


def _yaml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) else str(value)


def run_kbit(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(KBIT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def assert_ranks_on_node_hosts(result: dict[str, Any], testbed: BedState) -> None:
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    node_hosts = {n.name for n in testbed.nodes}
    assert {r["host"] for r in ranks} == node_hosts, ranks  # one rank on each node host
    subnet = ipaddress.ip_network(testbed.subnet)
    assert {r["address"] for r in ranks} == {n.address for n in testbed.nodes}
    assert all(ipaddress.ip_address(r["address"]) in subnet for r in ranks)


def assert_trained_on_node_hosts(
    done: subprocess.CompletedProcess[str], testbed: BedState, workdir: Path
) -> dict[str, Any]:
    """`kbit train --json` on the bed's train-cluster profile: one rank per node host, >= 90 %, nothing lost or left."""
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert_ranks_on_node_hosts(result, testbed)
    assert result["engine"] == "ddp" and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["test_accuracy"] >= 0.90, result["test_accuracy"]
    assert result["data"]["train"]["skipped_messages"] == 0 and result["data"]["train"]["gaps"] == 0
    assert processes_mentioning(str(workdir)) == [], "a process of the finished run is still running"
    return result


def test_ddp_trains_across_hosts_over_tls(testbed: BedState, tmp_path: Path, record_property) -> None:
    workdir = tmp_path / "train-cluster"
    started = time.monotonic()
    done = run_kbit("train", "--config", str(TRAIN_CLUSTER), "--json", *bed_sets(testbed, workdir))
    record_property("seconds", round(time.monotonic() - started, 1))
    assert_trained_on_node_hosts(done, testbed, workdir)


def test_deepspeed_zero2_trains_across_hosts(testbed: BedState, tmp_path: Path) -> None:
    done = run_kbit(
        "train",
        "--config",
        str(TRAIN_CLUSTER),
        "--json",
        *bed_sets(
            testbed,
            tmp_path / "ds",
            **{
                "deepspeed.enabled": True,
                "deepspeed.zero_stage": 2,
                "dataset.num_records": 2000,
                "train.epochs": 1,
                "tracking.enabled": False,
                "train.model": {"name": "mlp"},
            },
        ),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["engine"] == "deepspeed-zero2"
    assert_ranks_on_node_hosts(result, testbed)
    curve = result["loss_curve"]
    assert sum(curve[-5:]) / 5 < 0.9 * sum(curve[:5]) / 5, curve


def test_benchmark_runs_across_hosts(testbed: BedState, tmp_path: Path) -> None:
    workdir = tmp_path / "bench-cluster"
    done = run_kbit(
        "bench",
        "--config",
        str(BENCH_CLUSTER),
        "--json",
        *bed_sets(testbed, workdir, **{"bench.output_dir": str(workdir / "reports")}),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    configurations = result["configurations"]
    assert set(configurations) == {"raw_bytes_lz4.confluent", "protobuf_bytes_lz4.confluent"}
    for name, numbers in configurations.items():
        assert len(numbers["raw_load_s"]) == 2 * 2, name  # 2 iterations x 2 ranks
        assert all(seconds > 0 for seconds in numbers["raw_load_s"]), name
    assert Path(result["files"]["stats_json"]).is_file()


def test_a_lost_executor_mid_epoch_restarts_from_the_checkpoint(testbed: BedState, tmp_path: Path) -> None:
    marker = tmp_path / "executor-killed"
    model = {"name": "fault_models:kill_executor_once", "kwargs": {"at_step": 40, "marker": str(marker)}}
    done = run_kbit(
        "train",
        "--config",
        str(TRAIN_CLUSTER),
        "--json",
        *bed_sets(
            testbed,
            tmp_path / "lost",
            **{
                "dataset.num_records": 4000,
                "train.epochs": 2,
                "tracking.enabled": False,
                "train.model": model,
                "checkpoint.every_steps": 20,
                "checkpoint.max_restarts": 1,
                "launch.spark_conf": {"spark.executorEnv.PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
            },
        ),
        env={"PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
    )  # the driver's preflight imports the model too
    assert marker.exists(), f"the fault never fired:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["restarts"] == 1 and result["steps"] == 2 * 50
    assert "restart 1 of 1" in done.stderr and "with ExecutorLostFailure" in done.stderr
    assert_ranks_on_node_hosts(result, testbed)


def test_a_cluster_master_with_a_loopback_driver_is_refused_at_once(testbed: BedState, tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_kbit(
        "train",
        "--config",
        str(TRAIN_CLUSTER),
        *bed_sets(testbed, tmp_path / "loop", **{"launch.driver_host": "127.0.0.1"}),
        timeout=120,
    )
    assert done.returncode != 0
    assert "launch.driver_host=127.0.0.1 is a loopback address" in done.stderr
    assert time.monotonic() - started < 30

"""Pure parts of the launcher: Spark settings from LaunchConfig, and how worker failures are ranked and named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kbit_core.config import KbitConfig, LaunchConfig
from kbit_core.errors import DistributedError
from kbit_core.launch.distributor import (
    ExecutorLostError,
    RankDiedError,
    WorkerFailedError,
    _exception_type,
    _rank0_result,
    describe,
    worker_failure,
)
from kbit_core.launch.spark import spark_conf
from tests.conftest import free_port


def test_defaults_bind_loopback_quietly_and_fail_barrier_checks_fast(tmp_path: Path):
    conf = spark_conf(LaunchConfig(), tmp_path)
    assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert conf["spark.ui.enabled"] == conf["spark.ui.showConsoleProgress"] == "false"
    assert conf["spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures"] == "1"
    assert conf["spark.local.dir"] == str(tmp_path / "spark" / "local")
    assert conf["spark.executorEnv.DS_ACCELERATOR"] == "cpu"
    assert "-Dlog4j2.configurationFile=file:" in conf["spark.driver.extraJavaOptions"]
    assert not any("resource.gpu" in key for key in conf)


CLUSTER_DRIVER = {"driver_host": "10.213.7.1", "driver_bind_address": "0.0.0.0"}


def test_executor_sizing_is_passed_through(tmp_path: Path):
    conf = spark_conf(
        LaunchConfig(
            master="spark://h:7077",
            local_mode=False,
            executor_instances=3,
            executor_cores=5,
            executor_memory="24g",
            **CLUSTER_DRIVER,
        ),
        tmp_path,
    )
    assert (conf["spark.executor.instances"], conf["spark.executor.cores"], conf["spark.executor.memory"]) == (
        "3",
        "5",
        "24g",
    )


def test_a_cluster_driver_uses_its_configured_address_and_ports_and_executors_keep_their_own_tmp(tmp_path: Path):
    conf = spark_conf(
        LaunchConfig(
            master="spark://10.213.7.1:7077",
            local_mode=False,
            driver_port=40100,
            block_manager_port=40200,
            **CLUSTER_DRIVER,
        ),
        tmp_path,
    )
    assert (conf["spark.driver.host"], conf["spark.driver.bindAddress"]) == ("10.213.7.1", "0.0.0.0")
    assert (conf["spark.driver.port"], conf["spark.driver.blockManager.port"]) == ("40100", "40200")
    # the driver's scratch path need not exist on another host
    assert "spark.executorEnv.TMPDIR" not in conf
    assert "spark.executorEnv.TMPDIR" in spark_conf(LaunchConfig(), tmp_path)


def test_gpu_local_mode_asks_the_driver_for_one_gpu_per_process_with_a_generated_script(tmp_path: Path):
    (tmp_path / "spark").mkdir()
    conf = spark_conf(LaunchConfig(use_gpu=True, num_processes=2), tmp_path)
    assert conf["spark.driver.resource.gpu.amount"] == "2"
    script = Path(conf["spark.driver.resource.gpu.discoveryScript"])
    assert script.parent == tmp_path / "spark" and os.access(script, os.X_OK)
    assert "nvidia-smi" in script.read_text() and '\\"addresses\\"' in script.read_text()
    assert "spark.executorEnv.DS_ACCELERATOR" not in conf


def test_gpu_cluster_mode_sets_executor_task_and_local_cluster_worker_resources(tmp_path: Path):
    script = tmp_path / "gpus.sh"
    script.write_text("#!/bin/sh\n")
    conf = spark_conf(
        LaunchConfig(
            master="local-cluster[2,1,1024]",
            local_mode=False,
            use_gpu=True,
            executor_gpu_amount=2,
            task_gpu_amount=0.5,
            gpu_discovery_script=script,
        ),
        tmp_path,
    )
    assert conf["spark.executor.resource.gpu.amount"] == conf["spark.worker.resource.gpu.amount"] == "2"
    assert conf["spark.task.resource.gpu.amount"] == "0.5"
    assert conf["spark.executor.resource.gpu.discoveryScript"] == str(script)


def test_a_missing_discovery_script_is_named(tmp_path: Path):
    with pytest.raises(DistributedError, match="gpu_discovery_script does not exist: .*nope.sh"):
        spark_conf(LaunchConfig(use_gpu=True, gpu_discovery_script=tmp_path / "nope.sh"), tmp_path)


def test_user_spark_conf_wins_and_java_options_are_appended(tmp_path: Path):
    conf = spark_conf(
        LaunchConfig(spark_conf={"spark.ui.enabled": "true", "spark.driver.extraJavaOptions": "-Xss4m"}), tmp_path
    )
    assert conf["spark.ui.enabled"] == "true"
    assert conf["spark.driver.extraJavaOptions"].startswith("-Dlog4j2.configurationFile=")
    assert conf["spark.driver.extraJavaOptions"].endswith(" -Xss4m")


def test_the_rank_that_raised_is_blamed_not_the_peer_that_lost_it(tmp_path: Path):
    (tmp_path / "rank0.txt").write_text("Traceback ...\nRuntimeError: [gloo] Read error: Connection reset by peer")
    (tmp_path / "rank1.txt").write_text("Traceback ...\nValueError: bad labels")
    os.utime(tmp_path / "rank1.txt", (1, 1))  # the cause wrote its file later than the victim
    os.utime(tmp_path / "rank0.txt", (0, 0))
    error = worker_failure(RuntimeError("TorchDistributor failed"), tmp_path, KbitConfig(), "")
    assert (type(error), error.rank, error.exception_type) == (WorkerFailedError, "rank1", "ValueError")
    assert error.details.index("rank1") < error.details.index("--- rank0 also failed")
    assert str(error).startswith("rank1 raised: ValueError: bad labels; 1 other rank(s) failed after it (distributed")


def test_a_worker_error_is_one_line_naming_the_record_and_its_traceback_waits_for_debug(tmp_path: Path):
    """Issue 21 defect 7: the CorruptRecordError line was buried in ~110 lines of stacked tracebacks."""
    (tmp_path / "rank0.txt").write_text(
        'Traceback (most recent call last):\n  File "/x/loop.py", line 3, in step\n    batch = next(it)\n'
        "            ^^^^^^^^\nkbit_core.errors.CorruptRecordError: message does not decode as raw/bytes: bad\n"
        "length (topic=t, partition=1, offset=7)\n"
    )
    error = worker_failure(RuntimeError("TorchDistributor failed"), tmp_path, KbitConfig(), "")
    assert str(error) == (
        "rank0 raised: CorruptRecordError: message does not decode as raw/bytes: bad length (topic=t, partition=1, "
        f"offset=7) (distributed run: {describe(KbitConfig())}; tracebacks in {tmp_path}, printed with --debug)"
    )
    assert 'File "/x/loop.py", line 3' in error.details


def test_a_killed_rank_is_blamed_from_torchruns_record_even_when_only_its_peer_wrote_a_traceback(tmp_path: Path):
    (tmp_path / "rank0.txt").write_text("Traceback ...\nRuntimeError: [gloo] Connection closed by peer")
    output = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nRoot Cause (first observed "
        "failure):\n[0]:\n  time      : 2026-11-22_12:45:34\n  host      : node2\n  rank      : 1 "
        "(local_rank: 0)\n  exitcode  : -9 (pid: 4242)  (SIGKILL)\n"
    )
    error = worker_failure(RuntimeError("TorchDistributor failed"), tmp_path, KbitConfig(), output)
    assert isinstance(error, RankDiedError)
    assert (error.rank, error.host, error.exception_type) == ("rank1", "node2", "SIGKILL")
    assert "rank 1 on host node2 (pid 4242) killed by SIGKILL" in str(error)


def test_a_lost_executor_is_blamed_over_the_peer_it_disconnected(tmp_path: Path):
    (tmp_path / "rank0.txt").write_text("Traceback ...\nRuntimeError: [gloo] Connection closed by peer")
    spark_said = (
        "Could not recover from a failed barrier ResultStage. Most recent failure reason: Stage failed "
        "because barrier task ResultTask(0, 1) finished unsuccessfully.\nExecutorLostFailure (executor 1 "
        "exited caused by one of the running tasks) Reason: Command exited with code 137"
    )
    error = worker_failure(RuntimeError(spark_said), tmp_path, KbitConfig(), "")
    assert isinstance(error, ExecutorLostError) and (error.rank, error.exception_type) == (
        "rank1",
        "ExecutorLostFailure",
    )


def test_exception_type_comes_from_the_traceback_last_line():
    assert (
        _exception_type("Traceback ...\n  File x\nkbit_core.errors.ConfigError: bad: thing")
        == "kbit_core.errors.ConfigError"
    )
    assert _exception_type("") == ""


def test_a_rank_whose_agent_is_gone_keeps_its_result_instead_of_waiting_on_the_agents_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # the killed agent's store: nothing listens any more
    assert _rank0_result("result", rank=1, timeout_s=5, agent=os.getppid() + 1) == "result"


RANK_WAITING_ON_ITS_AGENT = """
import os, pathlib, sys
from kbit_core.launch.distributor import _rank0_result
out = pathlib.Path(sys.argv[1])
agent = os.getppid()
(out.parent / "ready").touch()
out.write_text(_rank0_result("mine", 1, 300.0, agent))
"""

AGENT_DYING_WITHOUT_ITS_STORE = """
import pathlib, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(out)], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
print(rank.pid, flush=True)
deadline = time.monotonic() + 60
while not (out.parent / "ready").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1)  # the rank is waiting on the store by now
"""


def test_a_rank_whose_agent_dies_while_it_waits_on_the_agents_store_keeps_its_result(tmp_path: Path) -> None:
    """Alive when the rank looked, the agent dies (its store with it) before the store answered: the rank no
    longer waits out its whole timeout (300 s here, 15 minutes by default) but looks at the agent again."""
    out = tmp_path / "result.txt"
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }  # nothing listens: the agent's store never answers
    agent = subprocess.run(
        [sys.executable, "-c", AGENT_DYING_WITHOUT_ITS_STORE, str(out), RANK_WAITING_ON_ITS_AGENT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rank = psutil.Process(int(agent.stdout.split()[0]))
    try:
        rank.wait(60)
    except psutil.TimeoutExpired:
        rank.kill()
        pytest.fail("the orphaned rank still waited on its dead agent's store a minute later")
    assert out.read_text() == "mine"

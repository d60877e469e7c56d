"""The real Spark standalone cluster from the pyspark distribution: a master on the driver host, a worker per node."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from kbit_core.service import Service
from kbit_core.testbed.network import Host, TestbedError, in_host

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def spark_home() -> Path:
    """The pyspark package directory: pip's pyspark ships the full distribution (bin/spark-class, jars/)."""
    try:
        # pyspark takes seconds to import: loaded only where Spark is used
        import pyspark
    except ModuleNotFoundError:
        raise TestbedError(
            "pyspark is not installed; the test bed runs the Spark standalone cluster it ships"
        ) from None
    home = Path(pyspark.__file__).parent
    if not (home / "bin" / "spark-class").is_file() or not (home / "jars").is_dir():
        raise TestbedError(f"the pyspark distribution at {home} lacks bin/spark-class or jars/")
    return home


def java_missing() -> str | None:
    """Why no Java runtime can be found, or None when one can."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and not (Path(java_home) / "bin" / "java").is_file():
        return f"a Java runtime (JAVA_HOME={java_home} has no bin/java)"
    if not java_home and shutil.which("java") is None:
        return "a Java runtime (no `java` on PATH and JAVA_HOME unset; Spark needs Java 17+)"
    return None


def _spark_env(host: Host, log_dir: Path, marker_env: dict[str, str]) -> dict[str, str]:
    log_dir.mkdir(parents=True, exist_ok=True)
    return {
        **marker_env,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": host.address,
        "SPARK_LOCAL_HOSTNAME": host.address,
        "SPARK_NO_DAEMONIZE": "1",
        "SPARK_LOG_DIR": str(log_dir),
    }


def master_service(run_dir: Path, host: Host, port: int, webui_port: int, marker_env: dict[str, str]) -> Service:
    argv = [
        str(spark_home() / "bin" / "spark-class"),
        MASTER_CLASS,
        "--host",
        host.address,
        "--port",
        str(port),
        "--webui-port",
        str(webui_port),
    ]
    return Service(
        "spark-master",
        run_dir,
        argv,
        marker=MASTER_CLASS,
        env=_spark_env(host, run_dir / "spark-logs", marker_env),
        health_url=f"http://{host.address}:{webui_port}/json/",
        url=f"spark://{host.address}:{port}",
        error_type=TestbedError,
    )


def worker_service(
    run_dir: Path,
    node: Host,
    master_url: str,
    port: int,
    webui_port: int,
    cores: int,
    memory: str,
    marker_env: dict[str, str],
) -> Service:
    node_dir = run_dir.parent / node.name
    work_dir, local_dir = node_dir / "work", node_dir / "local"
    for d in (work_dir, local_dir):
        d.mkdir(parents=True, exist_ok=True)
    argv = in_host(
        node,
        [
            str(spark_home() / "bin" / "spark-class"),
            WORKER_CLASS,
            master_url,
            "--host",
            node.address,
            "--port",
            str(port),
            "--webui-port",
            str(webui_port),
            "--cores",
            str(cores),
            "--memory",
            memory,
            "--work-dir",
            str(work_dir),
        ],
    )
    env = {**_spark_env(node, node_dir / "spark-logs", marker_env), "SPARK_LOCAL_DIRS": str(local_dir)}
    return Service(
        f"spark-worker-{node.name}",
        run_dir,
        argv,
        marker=WORKER_CLASS,
        env=env,
        host=node.address,
        port=port,
        url=f"{node.address}:{port}",
        error_type=TestbedError,
    )


def master_json(address: str, webui_port: int, timeout_s: float = 2.0) -> dict | None:
    """The master's JSON status page (workers with their state), or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}:{webui_port}/json/", timeout=timeout_s) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def alive_workers(address: str, webui_port: int) -> dict[str, str]:
    """Worker host -> worker id for every worker the master currently sees ALIVE."""
    page = master_json(address, webui_port) or {}
    return {w["host"]: w["id"] for w in page.get("workers", []) if w.get("state") == "ALIVE"}


def wait_for_workers(address: str, webui_port: int, hosts: list[str], timeout_s: float, workers: list[Service]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if set(hosts) <= set(alive_workers(address, webui_port)):
            return
        time.sleep(0.5)
    missing = sorted(set(hosts) - set(alive_workers(address, webui_port)))
    tails = "\n".join(f"--- {w.name} ({w.log_path}):\n{w.log_tail()}" for w in workers if (w.host or "") in missing)
    raise TestbedError(
        f"the Spark master does not see the workers on {', '.join(missing)} as ALIVE within {timeout_s:.0f}s:\n{tails}"
    )

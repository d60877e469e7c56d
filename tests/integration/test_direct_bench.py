"""`kbit bench-train --direct`: one dataset (arrays in a .npz file) trained read directly, streamed from Kafka and
read from Kafka into memory first, in one run on the real broker; direct's ratios are against the same run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
KBIT = Path(sys.executable).parent / "kbit"


def test_direct_mode_reports_each_mode_and_the_ratios_of_the_same_run(broker, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "set.npz", images=rng.integers(0, 256, (600, 1, 28, 28), dtype=np.uint8), labels=np.arange(600) % 10
    )
    out = tmp_path / "direct.json"
    sets = {
        "kafka.embedded.port": broker.port,
        "workdir": tmp_path / "kbit",
        "dataset.name": "arrays",
        "dataset.path": tmp_path / "set.npz",
        "train.global_batch_size": 32,
        "train.epochs": 1,
        "tracking.enabled": "false",
        "launch.engine": "torchrun",
        "launch.num_processes": 1,
    }
    done = subprocess.run(
        [str(KBIT), "bench-train", "-c", str(REPO / "deployments/train-smoke.yaml"), "--direct"]
        + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
        + ["--json", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    direct = json.loads(out.read_text())["direct"]
    assert direct == doc["direct"] and doc["config"]["dataset"] == "arrays" and doc["config"]["epochs"] == 2
    (rate,), (streamed,), (memory,) = (direct[f"{mode}_samples_per_s"] for mode in ("direct", "kafka_stream", "memory"))
    assert min(rate, streamed, memory) > 0
    assert direct["direct_vs_kafka_stream"] == pytest.approx(rate / streamed)
    assert direct["direct_vs_memory"] == pytest.approx(rate / memory)

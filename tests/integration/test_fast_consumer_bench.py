"""`kbit bench-train --fast-consumer`: with every training step a stand-in, streamed and in-memory training both run
on the real broker, and each streamed variant reports its ratio against the one in-memory baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
KBIT = Path(sys.executable).parent / "kbit"


def test_fast_consumer_mode_reports_streamed_over_in_memory(broker, tmp_path):
    out = tmp_path / "fast.json"
    sets = {
        "kafka.embedded.port": broker.port,
        "workdir": tmp_path / "kbit",
        "dataset.num_records": 600,
        "train.global_batch_size": 32,
        "tracking.enabled": "false",
        "launch.engine": "torchrun",
        "launch.num_processes": 1,
    }
    done = subprocess.run(
        [str(KBIT), "bench-train", "-c", str(REPO / "deployments/train-smoke.yaml"), "--fast-consumer", "0.5"]
        + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
        + ["-v", "avro_list_none", "--json", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    fast = json.loads(out.read_text())["fast_consumer"]
    assert fast == doc["fast_consumer"] and fast["stand_in_step_ms"] == 0.5
    assert list(fast["stream_by_variant"]) == ["raw_bytes_lz4", "avro_list_none"]
    (memory,) = fast["memory_samples_per_s"]
    for streamed in fast["stream_by_variant"].values():
        (rate,) = streamed["samples_per_s"]
        assert rate > 0 and streamed["vs_memory"] == pytest.approx(rate / memory)
    assert "throughput" not in doc  # only the loader's ceiling was measured

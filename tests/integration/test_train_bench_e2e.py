"""`kbit bench-train` end to end on the real broker and every launcher installed here: each measured mode
reports, and every streamed variant gets its own topic and its ratio against the one in-memory baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
KBIT = Path(sys.executable).parent / "kbit"


def test_bench_train_measures_every_mode_and_each_streamed_format(broker, tmp_path):
    out = tmp_path / "train_bench.json"
    done = subprocess.run(
        [
            str(KBIT),
            "bench-train",
            "-c",
            str(REPO / "deployments/train-smoke.yaml"),
            "--set",
            f"kafka.embedded.port={broker.port}",
            "--set",
            f"workdir={tmp_path / 'kbit'}",
            "--set",
            "dataset.num_records=400",
            "--set",
            "train.global_batch_size=32",
            "--set",
            "train.epochs=2",  # the fewest the benchmark runs (it measures the last epoch); the profile has 3
            "--set",
            "tracking.enabled=false",
            "-v",
            "avro_list_none",
            "-v",
            "raw_bytes_lz4",
            "--json",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert json.loads(out.read_text())["stream_by_variant"] == doc["stream_by_variant"]
    # the config's own format is measured once even when named again
    assert list(doc["stream_by_variant"]) == ["raw_bytes_lz4", "avro_list_none"]
    for streamed in doc["stream_by_variant"].values():
        (rate,) = streamed["samples_per_s"]
        assert rate > 0 and streamed["vs_memory"] == pytest.approx(rate / doc["throughput"]["memory_samples_per_s"][0])
    assert doc["throughput"]["kafka_vs_memory"] == doc["stream_by_variant"]["raw_bytes_lz4"]["vs_memory"]
    overheads = doc["launch_overhead_s"]
    assert set(overheads) == {
        "torchrun",
        "distributor_local_mode",
        "distributor_cluster_mode",
        "ray_train",
        "vs_torchrun",
    }
    assert all(seconds[0] > 0 for name, seconds in overheads.items() if name != "vs_torchrun")
    # same data, same seed: ZeRO-1 and DDP end on the same loss
    final = doc["step_time_s"]["final_loss"]
    assert final["ddp"] == final["deepspeed_zero1"] and len(final["ddp"]) == 1

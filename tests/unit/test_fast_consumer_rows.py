"""The fast-consumer benchmark's summary and table: each streamed variant against the one in-memory baseline, and
the stand-in step that trains nothing."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from kbit_core.bench.training.fast_consumer_bench import fast_consumer_table, summarize
from kbit_core.config import DataVariant, KbitConfig
from kbit_core.train.metrics import stand_in_step


def _run(samples_per_s: float) -> dict:
    return {"samples_per_s": samples_per_s, "data_wait_fraction": 0.1, "loss_curve": []}


def test_each_streamed_variant_is_a_ratio_to_the_in_memory_median_with_a_verdict():
    cfg = KbitConfig.from_dict({"train": {"global_batch_size": 512, "stand_in_step_ms": 0.2}})
    lists_variant = DataVariant(format="json", layout="list", compression="none")
    samples = {
        "memory": [_run(v) for v in (1000.0, 1200.0, 1100.0)],
        "kafka_stream": [_run(v) for v in (950.0, 1000.0, 1050.0)],
        f"kafka_stream_{lists_variant.name}": [_run(v) for v in (500.0, 550.0, 600.0)],
    }
    doc = summarize(cfg, "topic", samples, repeats=3, other_variants=[lists_variant])
    fast = doc["fast_consumer"]
    assert fast["stand_in_step_ms"] == 0.2 and doc["config"]["global_batch_size"] == 512
    own, lists = fast["stream_by_variant"][cfg.produce.variant.name], fast["stream_by_variant"][lists_variant.name]
    assert own["vs_memory"] == pytest.approx(1000 / 1100) and own["meets_target"] is True
    assert lists["vs_memory"] == pytest.approx(550 / 1100) and lists["meets_target"] is False
    console = Console(record=True, width=200)
    console.print(fast_consumer_table(doc))
    text = console.export_text()
    assert "stand-in step of 0.2 ms" in text and "0.500x" in text and "below" in text


def test_the_stand_in_step_busy_waits_and_counts_the_samples_without_loss():
    start = time.perf_counter()
    stats = stand_in_step(5.0, 128)
    assert time.perf_counter() - start >= 0.005
    assert (stats.count, stats.loss_sum, stats.correct, stats.finite) == (128, 0.0, 0.0, True)

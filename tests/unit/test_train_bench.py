"""The training benchmark's summary: ratios against same-run baselines, the 0.9x verdict, unmeasured modes."""

from __future__ import annotations

import pytest
from rich.console import Console

from kbit_core.bench.training.train_bench import _summarize, results_table
from kbit_core.config import DataVariant, KbitConfig


def _run(samples_per_s: float, final_loss: float = 0.5) -> dict:
    return {"samples_per_s": samples_per_s, "data_wait_fraction": 0.05, "loss_curve": [2.0, final_loss]}


def _summary(kafka: list[float], memory: list[float], overheads: dict, torchrun_stream: float = 1000.0) -> dict:
    """The config's launcher is TorchDistributor local mode, so its streamed run is ``kafka_stream``."""
    cfg = KbitConfig.from_dict({"train": {"global_batch_size": 64}})
    samples = {
        "kafka_stream": [_run(v) for v in kafka],
        "memory": [_run(v) for v in memory],
        "deepspeed_zero1": [_run(v) for v in (800.0, 1000.0, 1200.0)],
        "torchrun_stream": [_run(torchrun_stream)],
        "distributor_cluster_mode_stream": [_run(500.0)],
    }
    return _summarize(cfg, "topic", "deepspeed_zero1", samples, overheads, repeats=3)


def test_ratios_are_medians_against_the_same_run_baselines():
    doc = _summary(
        [900.0, 950.0, 1000.0],
        [1000.0, 1000.0, 1100.0],
        {
            "torchrun": [2.0, 3.0, 4.0],
            "distributor_local_mode": [4.0, 6.0, 5.0],
            "distributor_cluster_mode": [15.0, 16.0, 14.0],
        },
    )
    assert doc["throughput"]["kafka_vs_memory"] == pytest.approx(0.95)
    assert doc["config"]["launcher"] == "distributor_local_mode"
    assert doc["stream_samples_per_s_by_launcher"]["vs_torchrun"] == pytest.approx(
        {"distributor_local_mode": 0.95, "distributor_cluster_mode": 0.5}
    )
    assert doc["throughput"]["meets_target"] is True
    assert doc["launch_overhead_s"]["vs_torchrun"] == pytest.approx(
        {"distributor_local_mode": 5.0 / 3.0, "distributor_cluster_mode": 5.0}
    )
    # step time = global batch / samples per second; DeepSpeed's median 64/1000 against DDP's 64/1000
    assert doc["step_time_s"]["deepspeed_vs_ddp"] == pytest.approx(1.0)


def test_below_target_is_flagged_and_an_unmeasured_mode_stays_empty():
    doc = _summary(
        [500.0], [1000.0], {"torchrun": [2.0], "distributor_local_mode": [3.0], "distributor_cluster_mode": [None]}
    )
    assert doc["throughput"]["meets_target"] is False
    assert doc["launch_overhead_s"]["vs_torchrun"]["distributor_cluster_mode"] is None
    console = Console(record=True, width=200)
    console.print(results_table(doc))
    text = console.export_text()
    assert "0.500x" in text and "below" in text
    assert "distributor_cluster_mode" in text and "-x" not in text


def test_a_launcher_the_config_cannot_run_under_is_left_out_not_fatal():
    from kbit_core.bench.training.train_bench import available_launchers

    cfg = KbitConfig.from_dict({"launch": {"master": "local[2]", "num_processes": 3}})
    launchers = available_launchers(cfg)
    assert "torchrun" in launchers and "distributor_local_mode" in launchers
    assert "distributor_cluster_mode" not in launchers  # 3 barrier tasks do not fit local[2]


def test_every_streamed_variant_gets_its_ratio_and_verdict_against_the_one_memory_baseline():
    from kbit_core.bench.training.train_bench import stream_name

    cfg = KbitConfig.from_dict({"produce": {"variant": {"format": "raw", "layout": "bytes", "compression": "lz4"}}})
    avro, json_list = (DataVariant(format=f, layout="list", compression="none") for f in ("avro", "json"))
    samples = {
        "kafka_stream": [_run(950.0)],
        "memory": [_run(1000.0), _run(1000.0)],
        stream_name(avro): [_run(920.0), _run(880.0)],
        stream_name(json_list): [_run(600.0)],
        "deepspeed_zero1": [_run(900.0)],
        "torchrun_stream": [_run(950.0)],
    }
    doc = _summarize(
        cfg,
        "topic",
        "deepspeed_zero1",
        samples,
        {"torchrun": [2.0], "distributor_local_mode": [2.0]},
        repeats=2,
        other_variants=[avro, json_list],
    )
    by_variant = doc["stream_by_variant"]
    assert list(by_variant) == ["raw_bytes_lz4", "avro_list_none", "json_list_none"]
    assert [by_variant[v]["vs_memory"] for v in by_variant] == pytest.approx([0.95, 0.9, 0.6])
    assert [by_variant[v]["meets_target"] for v in by_variant] == [True, True, False]
    console = Console(record=True, width=200)
    console.print(results_table(doc))
    text = console.export_text()
    assert "samples/s kafka stream, avro_list_none" in text and "0.600x" in text


def test_bench_train_names_a_variant_it_cannot_parse_before_anything_starts():
    from typer.testing import CliRunner

    from kbit_core.cli import app

    refused = CliRunner().invoke(app, ["bench-train", "-v", "avro_list_lz4", "-v", "nope_list_lz4"])
    assert refused.exit_code == 1
    assert "variant 'nope_list_lz4' does not start with a format" in refused.output

"""What a reader of MLflow and Prefect sees: only the settings a run used, rounded; verdicts in words; record sizes
on the wire; schedules with their time zone."""

from __future__ import annotations

import json
from pathlib import Path

from kbit_core.bench.loading.report import markdown_summary, slower_count, timings_frame, write_report
from kbit_core.config import KbitConfig
from kbit_core.stack import schedule_lines
from kbit_core.stats.compare import compare_runs, no_baseline_verdict, regression_verdict
from kbit_core.tracking.params import config_params, readable, run_settings
from tests.unit.test_report import CONFIGS, synthetic_rows


def test_params_leave_out_what_the_run_never_read_and_round_floats() -> None:
    params = config_params(KbitConfig(), "benchmark")

    assert not [k for k in params if k.startswith(("launch.ray_", "kafka.sasl_", "kafka.ssl_", "kafka.bootstrap"))]
    assert not [k for k in params if k in ("launch.task_gpu_amount", "launch.executor_gpu_amount")]
    assert params["launch.master"] == "local[2]" and params["kafka.embedded.port"] == "19092"
    assert json.loads(params["shard.split_rates"]) == [0.8571, 0.07143, 0.07143]
    # The exact values stay in the run's config.json.
    assert json.loads(run_settings(KbitConfig(), "benchmark")["shard.split_rates"])[0] == 6 / 7


def test_params_keep_what_the_chosen_launcher_and_transport_read() -> None:
    cfg = KbitConfig.from_dict(
        {
            "launch": {"engine": "ray", "use_gpu": True},
            "kafka": {
                "bootstrap_servers": "kafka.example:9093",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
            },
        }
    )
    params = config_params(cfg, "train")

    assert "launch.ray_head_port" in params and "launch.master" not in params
    assert "kafka.sasl_mechanism" in params and "kafka.ssl_cafile" in params
    assert "kafka.bootstrap_servers" in params and not [k for k in params if k.startswith("kafka.embedded.")]
    # Training reads neither the benchmark's nor the stack's settings, and DeepSpeed's only when it is on.
    assert not [k for k in params if k.startswith(("bench.", "stack.", "sweep.", "stream.", "deepspeed.zero"))]
    assert params["deepspeed.enabled"] == "false"


def test_readable_rounds_floats_only_and_reaches_into_lists_and_dicts() -> None:
    assert readable({"a": [1 / 3, 7], "b": {"c": 1234567.891}, "d": True, "e": "0.333333"}) == {
        "a": [0.3333, 7],
        "b": {"c": 1235000.0},
        "d": True,
        "e": "0.333333",
    }


def test_summary_shows_wire_bytes_beside_the_value_size(tmp_path: Path) -> None:
    rows = synthetic_rows(iterations=3)
    meta = {"wire_bytes_per_record": {CONFIGS[0]: 812.4}}
    files = write_report(timings_frame(rows), meta, tmp_path, bootstrap_resamples=50, seed=0)
    doc = json.loads(files.stats_json.read_text())

    assert doc["throughput"][CONFIGS[0]]["wire_bytes_per_record"] == 812.4
    summary = markdown_summary(doc)
    assert "| value B/record | wire B/record |" in summary and "MB/s counts the uncompressed values" in summary
    line = next(x for x in summary.splitlines() if x.startswith(f"| {CONFIGS[0]} |") and x.endswith("| 812 |"))
    assert f"{doc['throughput'][CONFIGS[0]]['bytes_per_record']:,.0f} | 812 |" in line
    assert next(x for x in summary.splitlines() if x.startswith(f"| {CONFIGS[1]} |") and x.endswith("| ? |"))
    assert slower_count(doc) == "0 of 1 others significantly slower, 1 with too few runs to test"


def test_verdicts_name_regressions_or_say_there_is_nothing_to_compare() -> None:
    a = {"makespan": {"raw_results": {"x": [1.0, 1.01, 0.99, 1.02, 0.98], "y": [2.0, 2.01, 1.99, 2.02, 1.98]}}}
    b = {"makespan": {"raw_results": {"x": [1.0, 1.02, 0.98, 1.01, 0.99], "y": [3.0, 3.1, 2.9, 3.05, 2.95]}}}

    regressed = regression_verdict(compare_runs(a, b, 0.1).to_dict(), "MLflow run r1")
    same = regression_verdict(compare_runs(a, a, 0.1).to_dict(), "MLflow run r1")
    few = {"makespan": {"raw_results": {"x": [1.0, 1.1]}}}

    assert regressed.startswith("Regression: 1 of 2 configurations slower against MLflow run r1 (threshold 10%")
    assert regressed.endswith(": y +50.0%.")
    assert same.startswith("No regression against MLflow run r1") and same.endswith(": 2 same.")
    assert regression_verdict(compare_runs(few, few, 0.1).to_dict(), "r1").startswith("No verdict: too few")
    assert no_baseline_verdict("smoke", "kbit-smoke").startswith("No comparable baseline: no earlier finished 'smoke'")


def test_schedules_are_stated_with_their_time_zone() -> None:
    deployments = [
        {"name": "nightly", "schedules": [{"schedule": {"cron": "0 2 * * *", "timezone": "UTC"}, "active": True}]},
        {"name": "hourly", "schedules": [{"schedule": {"interval": 3600.0, "timezone": None}, "active": False}]},
        {"name": "smoke", "schedules": []},
    ]
    assert schedule_lines(deployments) == [
        "deployment 'nightly' is scheduled: cron 0 2 * * *, time zone UTC",
        "deployment 'hourly' is scheduled: interval 3600.0, time zone UTC (paused)",
    ]

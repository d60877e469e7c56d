"""One full small benchmark: real broker, TorchDistributor with 2 gloo ranks, real MLflow store, report files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.config import KbitConfig
from kbit_core.jobs.benchmark import matrix

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]

VARIANTS = [
    {"format": "avro", "layout": "list", "compression": "lz4"},
    {"format": "json", "layout": "bytes", "compression": "none"},
]


@pytest.fixture
def bench_config(make_config: Callable[..., KbitConfig], tmp_path: Path, spark: object) -> KbitConfig:
    return make_config(
        {
            "profile": "e2e",
            "dataset": {"num_records": 700},
            "produce": {"partitions": 2, "topic_prefix": f"e2e{tmp_path.name[-6:].replace('_', '')}"},
            "train": {"global_batch_size": 32, "model": {"name": "mlp"}},
            "bench": {
                "iterations": 2,
                "warmup_iterations": 0,
                "variants": VARIANTS,
                "train_epoch": True,
                "output_dir": str(tmp_path / "reports"),
                "bootstrap_resamples": 200,
            },
            "tracking": {"system_metrics": False},
        }
    )


def test_small_benchmark_end_to_end(bench_config: KbitConfig, tmp_path: Path) -> None:
    """`kbit bench --json` runs it; stdout must hold exactly one JSON document despite the workers' output."""
    profile = tmp_path / "bench.yaml"
    profile.write_text(yaml.safe_dump(bench_config.to_dict()))
    cli = CliRunner()
    run = cli.invoke(app, ["bench", "--config", str(profile), "--json", "--quiet"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)
    names = [c.name for c in matrix(bench_config)]
    assert names == ["avro_list_lz4.confluent", "json_bytes_none.confluent"]
    assert set(result["configurations"]) == set(names)
    assert result["configurations"][names[0]]["load_time"]["count"] == 4
    assert len(result["configurations"][names[0]]["raw_load_s"]) == 4

    files = {k: Path(v) for k, v in result["files"].items()}
    for path in files.values():
        assert path.is_file() and path.stat().st_size > 0, path
    raw = pd.read_csv(files["raw_csv"])
    assert len(raw) == 2 * 2 * 2  # iterations × ranks × configurations
    assert set(raw["config"]) == set(names) and set(raw["rank"]) == {0, 1}
    assert (raw["load_s"] > 0).all() and (raw["records"] > 0).all() and (raw["bytes"] > 0).all()
    # both ranks read equal shards, and together every record of the three splits (remainder 'drop' may trim)
    per_run = raw.groupby(["iteration", "config"])["records"].sum()
    assert ((per_run > 600) & (per_run <= 700)).all()
    assert (raw.groupby(["iteration", "config"])["is_slowest_rank"].sum() == 1).all()
    stages = raw[["connect_s", "fetch_s", "decode_s", "collate_s", "other_s"]].sum(axis=1)
    assert ((stages - raw["load_s"]).abs() < 1e-6).all() and (raw["connect_s"] > 0).all()
    # one confluent consumer per rank and configuration (it checks the bounds too); nothing skipped, padded or missing
    assert (raw["kafka_clients"] == 1).all()
    assert (raw[["skipped_messages", "gap_offsets", "padded_messages", "padded_records"]] == 0).all().all()
    assert (raw["train_epoch_s"] > 0).all() and (raw["train_samples_per_s"] > 0).all()

    stats = json.loads(files["stats_json"].read_text())
    assert stats["statistical_analysis"][names[0]]["count"] == 4
    assert stats["counters"][names[0]]["kafka_clients"] == 1
    assert stats["makespan"]["statistical_analysis"][names[0]]["count"] == 2
    assert {len(o) for o in stats["metadata"]["order"].values()} == {2}
    assert stats["metadata"]["world_size"] == 2
    assert stats["metadata"]["broker"].startswith(f"embedded {bench_config.kafka.embedded.broker} ")  # its version next

    client = MlflowClient(bench_config.tracking_uri())
    exp = client.get_experiment_by_name("kbit-e2e")
    parent_id = result["mlflow"]["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.params["bench.iterations"] == "2"
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert {r.data.tags["config"] for r in children} == set(names)
    for child in children:
        name = child.data.tags["config"]
        assert child.data.metrics["per_rank_median_s"] == pytest.approx(stats["statistical_analysis"][name]["median"])
        assert child.data.metrics["makespan_median_s"] == pytest.approx(
            stats["makespan"]["statistical_analysis"][name]["median"]
        )
        assert child.data.metrics["throughput_records_per_s_median"] > 0
        assert len(client.get_metric_history(child.info.run_id, "makespan_s")) == 2
        assert child.data.metrics["train_samples_per_s_median"] > 0
        assert child.data.metrics["max_skipped_messages"] == 0 and "max_padded_records" in child.data.metrics
    assert {r.info.run_id for r in children} == set(result["mlflow"]["child_run_ids"].values())
    artifacts = {a.path for a in client.list_artifacts(parent_id, "benchmark")}
    assert {f"benchmark/{p.name}" for p in files.values()} <= artifacts
    assert any(a.endswith(".json") and "e2e" in a for a in artifacts)  # the topics' manifests

    # kbit report rebuilds the same numbers from the CSV alone
    report_dir = result["report_dir"]
    rebuilt = cli.invoke(app, ["report", report_dir, "--json"])
    assert rebuilt.exit_code == 0, rebuilt.output
    after = json.loads(files["stats_json"].read_text())
    assert after["statistical_analysis"] == stats["statistical_analysis"]
    same = cli.invoke(app, ["compare", report_dir, report_dir, "--json"])
    assert same.exit_code == 0 and json.loads(same.stdout)["regressions"] == []

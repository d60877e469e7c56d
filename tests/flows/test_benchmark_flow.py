"""Flow `benchmark` on the real broker and Spark, and the nightly regression gate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.artifacts import Artifact

from flows.benchmark import benchmark
from flows.nightly import nightly
from kbit_core.brokers.broker import EmbeddedBroker
from tasks.bench import RegressionError, compare_with_baseline, fail_on_regressions
from tests.flows.helpers import delete_topics, flow_overrides, task_runs

TINY_BENCH = {
    "bench": {
        "iterations": 2,
        "warmup_iterations": 0,
        "bootstrap_resamples": 100,
        "decoders": None,
        "variants": [{"format": "raw", "layout": "bytes", "compression": "none"}],
    },
    "tracking": {"system_metrics": False},
}


@pytest.fixture
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def stats_doc(samples: dict[str, list[float]]) -> dict:
    """The part of a stats document the run-to-run comparison reads: makespans, one per iteration."""
    return {"makespan": {"raw_results": samples}}


def test_gate_passes_noise_and_fails_a_real_slowdown(tmp_path: Path) -> None:
    baseline = stats_doc({"avro": [1.0, 1.01, 0.99, 1.02, 0.98, 1.03], "json": [2.0, 2.02, 1.98, 2.01, 1.99, 2.03]})
    current = tmp_path / "stats.json"
    current.write_text(
        json.dumps(stats_doc({"avro": [1.0, 1.02, 0.98, 1.01, 0.99, 1.005], "json": [3.0, 3.1, 2.9, 3.05, 2.95, 3.01]}))
    )

    comparison = compare_with_baseline.fn(baseline, str(current), threshold=0.10)

    assert comparison["regressions"] == ["json"]
    with pytest.raises(
        RegressionError,
        match=r"1 configuration\(s\) regressed against MLflow run base-1 beyond "
        r"10%: json \+49\.9% \(Holm p=0\.00433\)",
    ):
        fail_on_regressions.fn(comparison, "base-1")
    fail_on_regressions.fn({**comparison, "deltas": [d for d in comparison["deltas"] if d["name"] == "avro"]}, "base-1")


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
def test_benchmark_reports_publishes_and_compares_with_the_previous_run(
    broker: EmbeddedBroker, tmp_path: Path, own_topics: None
) -> None:
    # A threshold no noise reaches: this checks the wiring; the gate itself is tested above.
    overrides = flow_overrides(
        broker, tmp_path, {**TINY_BENCH, "bench": {**TINY_BENCH["bench"], "regression_threshold": 100.0}}
    )

    # The first run as the smoke deployment starts it: no gate, but a verdict all the same.
    first = benchmark(profile="smoke", overrides=overrides, return_state=True)
    client = MlflowClient(overrides["tracking"]["tracking_uri"])
    assert first.result()["regression_verdict"].startswith("No comparable baseline: no earlier finished 'smoke'")
    # Its MLflow run names the flow run it came from.
    tags = client.get_run(first.result()["mlflow_run_id"]).data.tags
    assert tags["prefect.flow_run_id"] == str(first.state_details.flow_run_id)
    # The test's dataset and matrix are measurement overrides, which keep a run from being a baseline; the
    # deployment runs without them. Pretend the first run did, so the second one has its baseline.
    first_run = first.result()["mlflow_run_id"]
    assert "dataset.num_records" in json.loads(client.get_run(first_run).data.tags["kbit.overrides"])
    client.set_tag(first_run, "kbit.overrides", "{}")
    second = benchmark(profile="smoke", overrides=overrides, compare_with_previous=True, return_state=True)

    assert first.is_completed(), first.message
    assert second.is_completed(), second.message
    a, b = first.result(), second.result()
    assert Path(b["stats_json"]).is_file() and Path(b["summary_md"]).read_text().startswith("# kbit benchmark")
    assert client.get_run(b["mlflow_run_id"]).data.tags["kbit.kind"] == "benchmark"
    # The first run is the baseline; the second is compared with it.
    assert "compare-runs" not in task_runs(first) and task_runs(second)["compare-runs"].state.is_completed()
    summary = Artifact.get("kbit-benchmark-smoke")
    assert summary is not None and "raw_bytes_none" in summary.data
    # Two iterations per run cannot reach significance: the verdict says so, above the summary and the comparison.
    assert b["regression_verdict"].startswith(
        f"No verdict: too few iterations for a test against MLflow run {a['mlflow_run_id']}"
    )
    assert summary.data.split("\n")[2] == f"**{b['regression_verdict']}**"
    assert summary.data.startswith("# kbit benchmark smoke") and summary.data.count("\n# ") == 0  # one heading
    # The history: one override-free night of this identity (the first), said so in the artifact and in MLflow.
    assert task_runs(second)["draw-history"].state.is_completed()
    assert "1 night(s) of this identity" in summary.data and "## History" in summary.data
    note = client.get_run(b["mlflow_run_id"]).data.tags["mlflow.note.content"]
    assert note.startswith("**History: 1 night(s) of this identity") and "| 1 | raw_bytes_none.confluent |" in note
    assert {a.path for a in client.list_artifacts(b["mlflow_run_id"], "history")} == {
        "history/history.png",
        "history/history.md",
        "history/history.json",
    }
    regression = Artifact.get("kbit-regression-smoke")
    assert regression is not None and regression.data.startswith(f"**{b['regression_verdict']}**")


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
def test_nightly_flow_runs_the_nightly_profile_and_gates_on_the_previous_run(
    broker: EmbeddedBroker, tmp_path: Path, own_topics: None
) -> None:
    # Four iterations, one makespan each: the fewest for which Mann–Whitney can reach p < 0.05 (2/70); with
    # three the gate says "insufficient runs" instead of failing.
    # One cell of the nightly's records-per-message axis, grouped (8): with two cells, Holm's correction needs
    # p < 0.025, more than four iterations give; and 64 a message leaves a 240-record topic's validation split
    # without a message per rank (a ConfigError, as it should).
    bench = {**TINY_BENCH["bench"], "iterations": 4, "records_per_message": [8]}
    overrides = flow_overrides(broker, tmp_path, {**TINY_BENCH, "bench": bench})
    first = nightly(overrides=overrides, return_state=True)
    assert first.is_completed(), first.message
    client = MlflowClient(overrides["tracking"]["tracking_uri"])
    run = client.get_run(first.result()["mlflow_run_id"])
    assert run.data.tags["kbit.profile"] == "nightly"

    # A baseline that is 1000x faster than anything real makes the second night a loud regression.
    from kbit_core.tracking import BENCHMARK_ARTIFACT_DIR

    stats_path = Path(first.result()["stats_json"])
    doc = json.loads(stats_path.read_text())
    cells = list(doc["makespan"]["raw_results"])
    assert cells and all(cell.startswith("raw_bytes_none_x8") for cell in cells), cells  # the grouped cell ran
    doc["makespan"]["raw_results"] = {k: [v / 1000 for v in vs] for k, vs in doc["makespan"]["raw_results"].items()}
    stats_path.write_text(json.dumps(doc))
    client.log_artifact(run.info.run_id, str(stats_path), artifact_path=BENCHMARK_ARTIFACT_DIR)
    client.set_tag(run.info.run_id, "kbit.overrides", "{}")  # as if run without the test's overrides
    second = nightly(overrides=overrides, return_state=True)
    assert second.is_failed()
    assert "regressed" in second.message

"""Flow `benchmark`: produce, iterate, statistics, reports, MLflow; optionally gate on the previous run."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.bench import (
    compare_with_baseline,
    draw_history,
    fail_on_regressions,
    run_benchmark_iterations,
    state_verdict,
)
from tasks.config import load_run_config
from tasks.produce import ensure_dataset_topics
from tasks.report import publish_benchmark_summary, publish_regression_check
from tasks.tracking import mlflow_run_url, previous_benchmark, record_overrides


@flow(name="benchmark", log_prints=True)
def benchmark(
    profile: str = "smoke", overrides: dict[str, Any] | None = None, compare_with_previous: bool = False
) -> dict[str, Any]:
    """Benchmark the profile's matrix of formats, layouts and compressions.

    Steps:
      1. Load and validate the profile with the overrides.
      2. Ensure the topics of every ``bench.variants`` entry (at each ``bench.records_per_message``) (matching manifests are reused).
      3. Run the warm-up and measured iterations; statistics, reports and the MLflow parent run come out.
      4. Record the overrides that change what is measured on the MLflow run (a run with any is no baseline).
      5. With ``compare_with_previous`` (the nightly deployment): draw the history of this profile's nights
         (median and CI per night, change points with their commit ranges, unstable configurations) into
         the report and the MLflow run.
      6. Find the newest finished run of this profile with the same identity and no overrides in MLflow and
         compare with it: the verdict (or "no comparable baseline") is logged, returned and published.
      7. Publish the summary table (under the verdict, with the history) and a link to the MLflow run as a
         markdown artifact, and the comparison when there was one.
      8. With ``compare_with_previous``: fail on a significant regression.
    """
    cfg = load_run_config(profile, overrides)
    ensure_dataset_topics(cfg, cfg.bench.matrix_variants())
    result = run_benchmark_iterations(cfg)
    record_overrides(cfg, result["mlflow_run_id"], overrides)
    run_url = mlflow_run_url(cfg, result["mlflow_run_id"])
    history = draw_history(cfg, result["mlflow_run_id"], result["report_dir"]) if compare_with_previous else None
    # Without tracking there is nowhere to find a baseline: the gate refuses that, a plain run says so.
    find = compare_with_previous or cfg.tracking.enabled
    baseline = previous_benchmark(cfg, result["mlflow_run_id"], result["stats_json"]) if find else None
    comparison = (
        compare_with_baseline(baseline["stats"], result["stats_json"], cfg.bench.regression_threshold)
        if baseline
        else None
    )
    verdict = state_verdict(cfg, comparison, baseline and baseline["run_id"])
    publish_benchmark_summary(cfg.profile, result["summary_md"], run_url, history, verdict)
    if baseline and comparison:
        publish_regression_check(cfg.profile, comparison, baseline["run_id"], verdict)
        if compare_with_previous:
            fail_on_regressions(comparison, baseline["run_id"])
    return {**result, "regression_verdict": verdict}


if __name__ == "__main__":
    benchmark(profile="smoke")

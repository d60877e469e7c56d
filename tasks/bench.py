"""Benchmark tasks: run the iterations, and hold a run against its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from kbit_core import tracking
from kbit_core.bench.loading.report import RANKING_METRIC, load_stats
from kbit_core.config import KbitConfig
from kbit_core.errors import KbitError
from kbit_core.jobs.benchmark import run_benchmark
from kbit_core.jobs.history import history_report
from kbit_core.stats.compare import compare_runs, no_baseline_verdict, regression_message, regression_verdict
from kbit_core.stats.history import history_markdown
from tasks.policy import BACKOFF_S, is_transient, show_progress

# Nights the nightly history looks back over: two months of nights keeps the plot readable.
HISTORY_NIGHTS = 60


class RegressionError(KbitError):
    """A benchmark configuration got significantly slower than in the baseline run."""


@task(
    name="run-benchmark",
    retries=1,
    retry_delay_seconds=BACKOFF_S[1],
    retry_condition_fn=is_transient,
    timeout_seconds=12 * 3600,
)
def run_benchmark_iterations(cfg: KbitConfig) -> dict[str, Any]:
    """Run the benchmark matrix; return where its report went and its MLflow parent run."""
    result = run_benchmark(cfg, progress=show_progress())
    summary = {
        "run_id": result.run_id,
        "report_dir": str(result.report_dir),
        "stats_json": str(result.files.stats_json),
        "summary_md": str(result.files.summary_md),
        "mlflow_run_id": result.parent_run_id,
        "fastest": result.stats["comparison"][RANKING_METRIC]["fastest"],
    }
    get_run_logger().info("benchmark report in %s (MLflow run %s)", summary["report_dir"], summary["mlflow_run_id"])
    return summary


@task(name="compare-runs")
def compare_with_baseline(baseline_stats: dict[str, Any], current_stats_json: str, threshold: float) -> dict[str, Any]:
    """Per-configuration change of the median makespan per iteration against the baseline (Mann–Whitney, Holm)."""
    return compare_runs(baseline_stats, load_stats(Path(current_stats_json)), threshold).to_dict()


@task(name="check-regressions")
def fail_on_regressions(comparison: dict[str, Any], baseline_run_id: str) -> None:
    """Raise, naming every regressed configuration, when the comparison found any."""
    message = regression_message(comparison, f"MLflow run {baseline_run_id}")
    if message:
        raise RegressionError(message)


@task(name="regression-verdict")
def state_verdict(cfg: KbitConfig, comparison: dict[str, Any] | None, baseline_run_id: str | None) -> str:
    """The run's regression verdict in one sentence, or that it had no comparable baseline; logged (a regression
    as a warning) and returned for the summary artifact and the flow's result."""
    if comparison is None or baseline_run_id is None:
        verdict = no_baseline_verdict(cfg.profile, cfg.experiment_name())
    else:
        verdict = regression_verdict(comparison, f"MLflow run {baseline_run_id}")
    log = get_run_logger()
    (log.warning if comparison and comparison["regressions"] else log.info)("%s", verdict)
    return verdict


@task(
    name="draw-history",
    retries=2,
    retry_delay_seconds=BACKOFF_S[:2],
    retry_condition_fn=is_transient,
    timeout_seconds=600,
)
def draw_history(cfg: KbitConfig, run_id: str | None, report_dir: str) -> dict[str, Any]:
    """Each configuration's nightly median with its CI, change points and unstable configurations, written next
    to the report and attached to the MLflow run (plot, table, and the verdict in its description)."""
    history, files, left_out = history_report(cfg, Path(report_dir) / "history", HISTORY_NIGHTS)
    table = history_markdown(history)
    tracking.log_history(cfg, run_id, list(files.values()), history.verdict(), table)
    log = get_run_logger()
    log.info(history.verdict())
    for reason in left_out:
        log.info("left out of the history: %s", reason)
    return {
        "verdict": history.verdict(),
        "table": table,
        "unstable": history.unstable,
        "change_points": {name: [cp.commits for cp in cps] for name, cps in history.change_points.items()},
    }

"""Prefect markdown artifacts: the benchmark summary with its MLflow link, the regression check, the sweep table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from kbit_core.stats.compare import COMPARISON_COLUMNS, comparison_rows


def _key(text: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


@task(name="publish-benchmark-summary")
def publish_benchmark_summary(
    profile: str,
    summary_md: str,
    mlflow_run_url: str | None,
    history: dict[str, Any] | None = None,
    verdict: str | None = None,
) -> str:
    """Publish the report's summary tables (file ``summary_md``, which carries the one heading) under the run's
    regression verdict, the history's verdict and table when drawn, and where to find the run in MLflow."""
    link = f"[Open the run in MLflow]({mlflow_run_url})\n\n" if mlflow_run_url else ""
    summary = Path(summary_md).read_text()
    title, _, body = summary.partition("\n")
    verdicts = "".join(f"**{v}**\n\n" for v in (verdict, history and history["verdict"]) if v)
    parts = [title, "", verdicts + link, body.lstrip("\n")]
    if history:
        parts += ["## History", "", history["table"]]
    artifact_id = create_markdown_artifact(
        markdown="\n".join(parts),
        key=_key(f"kbit-benchmark-{profile}"),
        description=f"kbit benchmark summary ({profile})",
    )
    return str(artifact_id)


@task(name="publish-training-summary")
def publish_training_summary(profile: str, summary: dict[str, Any], mlflow_run_url: str | None) -> str:
    """Publish a training's final metrics, rounded, under a link to its MLflow run."""
    run_id = summary.get("mlflow_run_id")
    link = (
        f"[Open the run in MLflow]({mlflow_run_url})" if mlflow_run_url else f"MLflow run `{run_id or 'not tracked'}`"
    )
    rows = [f"| {name} | {value:.4g} |" for name, value in sorted(summary["metrics"].items())]
    artifact_id = create_markdown_artifact(
        markdown="\n".join([f"# kbit training {profile}", "", link, "", "| metric | final |", "|---|---|", *rows]),
        key=_key(f"kbit-train-{profile}"),
        description=f"kbit training summary ({profile})",
    )
    return str(artifact_id)


@task(name="publish-regression-check")
def publish_regression_check(profile: str, comparison: dict[str, Any], baseline_run_id: str, verdict: str) -> str:
    """Publish the run-to-run comparison under its verdict as a table, regressions first."""
    rows = sorted(comparison["deltas"], key=lambda d: (d["verdict"] != "regression", -d["change_pct"]))
    lines = [
        f"**{verdict}**",
        "",
        f"Baseline MLflow run `{baseline_run_id}`; threshold {comparison['threshold']:.0%}, "
        f"alpha {comparison['alpha']} (Holm-corrected), `{comparison['metric']}` per iteration.",
        "",
        "| " + " | ".join(COMPARISON_COLUMNS) + " |",
        "|---" * len(COMPARISON_COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in comparison_rows(rows)]
    for side, names in (("only in the baseline", comparison["only_in_a"]), ("new", comparison["only_in_b"])):
        if names:
            lines.append(f"\n{side}: {', '.join(names)}")
    artifact_id = create_markdown_artifact(
        markdown="\n".join(lines),
        key=_key(f"kbit-regression-{profile}"),
        description=f"kbit run-to-run comparison ({profile})",
    )
    return str(artifact_id)


@task(name="publish-sweep-table")
def publish_sweep_table(results: list[dict[str, Any]], best: dict[str, Any], metric: str) -> str:
    """Publish one row per trial (parameters and the chosen metric), the best one marked."""
    keys = sorted(results[0]["params"]) if results else []
    lines = ["| trial | " + " | ".join(keys) + f" | {metric} | MLflow run | |", "|---" * (len(keys) + 4) + "|"]
    for r in results:
        mark = "best" if r["trial"] == best["trial"] else ""
        lines.append(
            f"| {r['trial']} | "
            + " | ".join(str(r["params"][k]) for k in keys)
            + f" | {r['metrics'][metric]:.4g} | {r['mlflow_run_id'] or '-'} | {mark} |"
        )
    artifact_id = create_markdown_artifact(
        markdown="\n".join(lines), key="kbit-sweep", description=f"kbit sweep trials by {metric}"
    )
    return str(artifact_id)

"""What kbit asks of the MLflow store: a run's page, the benchmark baseline and history, tags added afterwards."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.kafka.settings import mask
from kbit_core.stats.history import Night
from kbit_core.stats.identity import identity_differences, measurement_overrides
from kbit_core.stats.metrics import stat_metric_name
from kbit_core.tracking.artifacts import storing
from kbit_core.tracking.client import mlflow_client
from kbit_core.tracking.trackers import (
    BENCHMARK_ARTIFACT_DIR,
    HISTORY_ARTIFACT_DIR,
    IDENTITY_HASH_TAG,
    IDENTITY_TAG,
    MODEL_TRAINING_VIEW,
    NOTE_TAG,
    OVERRIDES_TAG,
    run_description,
)


def run_url(cfg: KbitConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI; None when not tracked or the store has no UI of its own (sqlite)."""
    uri = cfg.tracking_uri()
    if run_id is None or not uri.startswith(("http://", "https://")):
        return None
    experiment_id = mlflow_client(cfg).get_run(run_id).info.experiment_id
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def record_overrides(cfg: KbitConfig, run_id: str | None, overrides: Mapping[str, Any] | None) -> dict[str, str]:
    """Tag a benchmark run with the overrides that change what it measures (masked; '{}' when none).

    Only a run tagged '{}' can become a baseline (:func:`previous_benchmark`); returns what was recorded.
    """
    recorded = mask(measurement_overrides(overrides))
    if run_id is not None and cfg.tracking.enabled:
        mlflow_client(cfg).set_tag(run_id, OVERRIDES_TAG, json.dumps(recorded, sort_keys=True))
    return recorded


def previous_benchmark(
    cfg: KbitConfig, current_run_id: str | None, identity: Mapping[str, Any], stats_file: str
) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest finished benchmark of this profile that has ``identity`` and was started without measurement
    overrides, with its stats document; and why each newer run was passed over.

    None when there is none (the first night of an identity sets the baseline).
    """
    client = mlflow_client(cfg)
    experiment = client.get_experiment_by_name(cfg.experiment_name())
    if experiment is None:
        return None, []
    runs = _finished_benchmarks(client, experiment.experiment_id, cfg.profile, max_results=50)
    passed_over: list[str] = []
    for run in runs:
        tags, run_id = run.data.tags, run.info.run_id
        if run_id == current_run_id:
            continue
        if tags.get(OVERRIDES_TAG) != "{}":
            passed_over.append(f"{run_id}: started with overrides {tags.get(OVERRIDES_TAG, '(not recorded)')}")
            continue
        differences = identity_differences(json.loads(tags.get(IDENTITY_TAG, "{}")), identity)
        if differences:
            passed_over.append(f"{run_id}: differs in {'; '.join(differences)}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            local = client.download_artifacts(run_id, f"{BENCHMARK_ARTIFACT_DIR}/{stats_file}", tmp)
            stats = json.loads(Path(local).read_text())
        return {"run_id": run_id, "experiment": experiment.name, "stats": stats}, passed_over
    return None, passed_over


def log_history(cfg: KbitConfig, run_id: str | None, files: Sequence[Path], verdict: str, table: str) -> None:
    """Attach the history files to the benchmark run (under ``history/``); its description gets the verdict on
    top and the history table below the ranking."""
    if run_id is None or not cfg.tracking.enabled:
        return
    client = mlflow_client(cfg)
    for path in files:
        with storing(cfg, run_id, f"{HISTORY_ARTIFACT_DIR}/{path.name}"):
            client.log_artifact(run_id, str(path), artifact_path=HISTORY_ARTIFACT_DIR)
    note = client.get_run(run_id).data.tags.get(NOTE_TAG, "")
    client.set_tag(run_id, NOTE_TAG, run_description(f"**{verdict}**\n\n{note}\n## History\n\n{table}"))


def benchmark_nights(cfg: KbitConfig, last: int | None = None) -> tuple[list[Any], list[str]]:
    """The finished, override-free benchmark runs of this profile that share the newest such run's identity, as
    ``stats.history.Night``s (oldest first, at most ``last``), and what was left out and why."""
    client = mlflow_client(cfg)
    experiment = client.get_experiment_by_name(cfg.experiment_name())
    if experiment is None:
        return [], [f"no experiment {cfg.experiment_name()!r} at {cfg.tracking_uri()}"]
    runs = _finished_benchmarks(client, experiment.experiment_id, cfg.profile, max_results=1000)
    eligible = [r for r in runs if r.data.tags.get(OVERRIDES_TAG) == "{}" and IDENTITY_HASH_TAG in r.data.tags]
    if not eligible:
        return [], [f"all {len(runs)} run(s) were started with overrides or record no identity"]
    newest = eligible[0].data.tags[IDENTITY_HASH_TAG]
    same = [r for r in eligible if r.data.tags[IDENTITY_HASH_TAG] == newest]
    left_out = [
        f"{len(runs) - len(eligible)} run(s) started with overrides or without a recorded identity",
        f"{len(eligible) - len(same)} run(s) of another identity than the newest run's ({newest})",
    ]
    same = same[:last]
    stats = [stat_metric_name("makespan", s) for s in ("median", "median_ci_low", "median_ci_high")]
    nights = []
    for run in reversed(same):
        children = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'", max_results=1000
        )
        nights.append(
            Night(
                run_id=run.info.run_id,
                started=datetime.fromtimestamp(run.info.start_time / 1000, UTC).isoformat(timespec="minutes"),
                commit=run.data.tags.get("git_commit", "unknown"),
                medians={
                    c.data.tags["config"]: tuple(c.data.metrics[m] for m in stats)
                    for c in children
                    if all(m in c.data.metrics for m in stats)
                },
            )
        )
    return nights, left_out


def _finished_benchmarks(client: Any, experiment_id: str, profile: str, max_results: int) -> list[Any]:
    """The finished benchmark runs of ``profile``, newest first: the baseline's and the history's candidates."""
    return client.search_runs(
        [experiment_id],
        filter_string=(
            f"tags.`kbit.kind` = 'benchmark' and tags.`kbit.profile` = '{profile}' and attributes.status = 'FINISHED'"
        ),
        order_by=["attributes.start_time DESC"],
        max_results=max_results,
    )

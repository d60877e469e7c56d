"""Streaming benchmark: per format, the highest produce rate continuous training sustains, and its freshness.

One continuous training run per variant, against a live producer that climbs a staircase of rates: first the
fixed rate (its stage also absorbs the trainer's start-up), then each rate of ``rates`` for ``stage_s``
seconds. Every report window of the trainer is placed in the stage it ended in. A stage is *sustained* when the
trainer trained at least 90 % of what the producer achieved in it and its lag did not grow over the stage by more
than half a second of records; the answer is the highest achieved rate below which every stage was sustained (the
search climbs until the first stage that is not). A stage whose producer fell short of its target is marked
``producer_limited``: there the producer, not the trainer, was the bound. Freshness (produce time to the step that trained the record) is reported
for the fixed-rate stage after the start-up backlog is drained: the median over its windows of each window's
p50/p95/p99.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rich.table import Table

from kbit_core.config import DataVariant, KbitConfig
from kbit_core.jobs.train import train
from kbit_core.stream.live_producer import LiveProducer

log = logging.getLogger(__name__)

RESULTS_FILE = "stream_bench.json"
KEEP_UP = 0.9  # trained at least this share of the produced rate
LAG_SLACK_S = 0.5  # lag may grow by this many seconds of records over a stage


def run_stream_bench(
    cfg: KbitConfig,
    variants: list[DataVariant],
    rates: list[float],
    *,
    fixed_rate: float,
    warmup_s: float,
    stage_s: float,
    output: Path | None = None,
) -> dict[str, Any]:
    """Measure every variant; the results document (also written to ``output`` or the bench output dir)."""
    results = []
    for variant in variants:
        run_cfg = cfg.override(
            {
                "produce.variant": variant.model_dump(),
                "train.mode": "continuous",
                "stream": {
                    "topic": f"kbit.bench-stream.{variant.name}.{uuid.uuid4().hex[:8]}",
                    "start": "earliest",
                    "stop_after_s": None,
                    "stop_after_records": None,
                },
                "checkpoint.dir": None,
                "tracking.enabled": False,
            }
        )
        stages: list[dict[str, float]] = []
        producer = threading.Thread(target=_staircase, args=(run_cfg, fixed_rate, warmup_s, rates, stage_s, stages))
        producer.start()
        try:
            result = train(run_cfg, progress=False)
        finally:
            producer.join()
        results.append(
            {
                "variant": variant.name,
                **_analyse(result["history"], stages, fixed_rate),
                "test_accuracy": result["test_accuracy"],
                "records": result["records_this_run"],
                "raw": {"stages": stages, "windows": result["history"]},
            }
        )
    doc = {
        "rates": rates,
        "fixed_rate": fixed_rate,
        "warmup_s": warmup_s,
        "stage_s": stage_s,
        "world_size": cfg.launch.num_processes,
        "model": cfg.train.model.name,
        "global_batch_size": cfg.train.global_batch_size,
        "results": results,
    }
    path = output or cfg.run_dir / "reports" / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return doc


def _staircase(
    cfg: KbitConfig,
    fixed_rate: float,
    warmup_s: float,
    rates: list[float],
    stage_s: float,
    stages: list[dict[str, float]],
) -> None:
    """Produce at ``fixed_rate`` for ``warmup_s``, then each of ``rates`` for ``stage_s``, noting each stage."""
    producer = LiveProducer(cfg)
    for rate, seconds in [(fixed_rate, warmup_s), *((r, stage_s) for r in rates)]:
        start = time.time()
        run = producer.run(rate=rate, duration_s=seconds)
        stages.append({"rate": rate, "start": start, "end": time.time(), "produced": run.produced})


def _analyse(history: list[dict[str, Any]], stages: list[dict[str, float]], fixed_rate: float) -> dict[str, Any]:
    """Per stage: trained rate and lag growth; the highest sustained rate; freshness at the fixed rate."""
    per_stage = []
    for stage in stages:
        windows = [w for w in history if stage["start"] <= w["wall_time"] < stage["end"]]
        if len(windows) < 2:
            per_stage.append({"rate": stage["rate"], "sustained": None, "windows": len(windows)})
            continue
        produced_rate = stage["produced"] / (stage["end"] - stage["start"])
        seconds = windows[-1]["wall_time"] - windows[0]["wall_time"]
        trained_rate = (windows[-1]["records"] - windows[0]["records"]) / seconds if seconds > 0 else 0.0
        lag_growth = windows[-1]["lag_records"] - windows[0]["lag_records"]
        sustained = trained_rate >= KEEP_UP * produced_rate and lag_growth <= LAG_SLACK_S * produced_rate
        per_stage.append(
            {
                "rate": stage["rate"],
                "produced_rate": produced_rate,
                "producer_limited": produced_rate < KEEP_UP * stage["rate"],
                "sustained": sustained,
                "windows": len(windows),
                "trained_rate": trained_rate,
                "lag_growth_records": lag_growth,
                "lag_end_records": windows[-1]["lag_records"],
            }
        )
    max_rate, producer_limited = None, False
    for stage in per_stage[1:]:
        if not stage["sustained"]:
            break
        max_rate = max(max_rate or 0.0, stage["produced_rate"])
        producer_limited = stage["producer_limited"]
    warm = [
        w
        for w in history
        if stages
        and stages[0]["start"] <= w["wall_time"] < stages[0]["end"]
        and w["lag_seconds"] < 1.0
        and w["freshness_p50_s"] is not None
    ]
    freshness = {
        q: (statistics.median(w[f"freshness_{q}_s"] for w in warm) if warm else None) for q in ("p50", "p95", "p99")
    }
    return {
        "max_sustained_rate": max_rate,
        "producer_limited": producer_limited,
        "freshness_s": freshness,
        "freshness_windows": len(warm),
        "fixed_rate": fixed_rate,
        "stages": per_stage,
    }


def results_table(doc: dict[str, Any]) -> Table:
    table = Table(
        title=f"streaming benchmark: {doc['world_size']} rank(s), {doc['model']}, batch "
        f"{doc['global_batch_size']}; rates {doc['rates']} for {doc['stage_s']:.0f} s each"
    )
    for column in (
        "variant",
        "max sustained records/s",
        f"freshness p50 s @ {doc['fixed_rate']:.0f}/s",
        "p95 s",
        "p99 s",
        "test accuracy",
    ):
        table.add_column(column, justify="right")
    for r in doc["results"]:
        fresh = r["freshness_s"]
        rate = "-" if r["max_sustained_rate"] is None else f"{r['max_sustained_rate']:,.0f}"
        table.add_row(
            r["variant"],
            rate + (" (producer-bound)" if r["producer_limited"] else ""),
            *("-" if fresh[q] is None else f"{fresh[q]:.3f}" for q in ("p50", "p95", "p99")),
            "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}",
        )
    return table

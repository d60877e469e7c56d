"""`kbit bench-train --fast-consumer MS`: the loader's ceiling on CPU. Every rank's training step is a stand-in
(``train.stand_in_step_ms``: a busy wait holding the interpreter lock, no model), as a fast GPU step would be, so
Kafka-streamed ÷ in-memory samples/s shows how much of what the in-memory loader feeds the stream loader keeps up
with, for the config's variant and every other one asked for. Target: >= 0.9x, as for real training."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kbit_core.bench.training.train_bench import (
    STREAM_TARGET,
    add_variant_row,
    bench_config,
    by_variant,
    fmt,
    median,
    produce_topics,
    run_settings,
    stream_variants,
    write_results,
)
from kbit_core.brokers.local import embedded_broker
from kbit_core.config import DataVariant, KbitConfig
from kbit_core.launch import launch
from kbit_core.train.worker import train_main

RESULTS_FILE = "train_bench_fast_consumer.json"


def run_fast_consumer_bench(
    cfg: KbitConfig,
    *,
    step_ms: float,
    output: Path | None = None,
    repeats: int = 1,
    variants: Sequence[DataVariant] = (),
) -> dict[str, Any]:
    """In-memory and streamed training with the stand-in step of ``step_ms``, ``repeats`` rounds in shuffled order;
    writes and returns the JSON (see :func:`summarize`)."""
    base = bench_config(cfg).override({"train": {"stand_in_step_ms": step_ms}})
    stream = base.override({"train": {"data": "kafka"}, "reader": {"mode": "stream"}})
    trainings = {"kafka_stream": stream, "memory": base.override({"train": {"data": "memory"}})}
    other_variants = stream_variants(trainings, stream, variants)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trainings}
    order = random.Random(cfg.bench.seed)
    with embedded_broker(base):
        manifest, manifests = produce_topics(base, trainings, other_variants)
        with Progress(transient=True) as progress:
            task = progress.add_task("fast-consumer bench", total=repeats * len(trainings))
            for _ in range(repeats):
                names = list(trainings)
                order.shuffle(names)  # no measurement always runs first (cold caches) or last
                for name in names:
                    samples[name].append(launch(train_main, trainings[name], manifests[name], str(base.run_dir)))
                    progress.advance(task)
    results = summarize(base, manifest.topic, samples, repeats, other_variants)
    return write_results(results, output or Path(cfg.bench.output_dir).resolve() / RESULTS_FILE)


def summarize(
    cfg: KbitConfig,
    topic: str,
    samples: dict[str, list[dict[str, Any]]],
    repeats: int,
    other_variants: Sequence[DataVariant] = (),
) -> dict[str, Any]:
    """The stand-in step, the in-memory baseline and each streamed variant's samples/s and ratio against it."""
    speed = {name: [r["samples_per_s"] for r in runs] for name, runs in samples.items()}
    return {
        "config": run_settings(cfg, topic, repeats),
        "fast_consumer": {
            "stand_in_step_ms": cfg.train.stand_in_step_ms,
            "memory_samples_per_s": speed["memory"],
            "target": STREAM_TARGET,
            "stream_by_variant": by_variant(cfg, speed, samples, other_variants),
        },
    }


def fast_consumer_table(results: dict[str, Any]) -> Table:
    """The in-memory baseline, then each streamed variant with its ratio and verdict."""
    config, fast = results["config"], results["fast_consumer"]
    table = Table(
        title=f"loader ceiling: stand-in step of {fast['stand_in_step_ms']:g} ms ({config['world_size']} processes "
        f"under {config['launcher']}, batch {config['global_batch_size']}, {config['repeats']} round(s))"
    )
    for column in ("measure", "median", "ratio", "baseline"):
        table.add_column(column, justify="left" if column in ("measure", "baseline") else "right")
    table.add_row("samples/s in memory", fmt(median(fast["memory_samples_per_s"]), "{:,.0f}"), "1.000x", "")
    for variant, streamed in fast["stream_by_variant"].items():
        add_variant_row(table, variant, streamed, fast["target"])
    return table

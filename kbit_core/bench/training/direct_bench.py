"""`kbit bench-train --direct`: training straight from the dataset (``train.data: direct``, no Kafka) against the
same dataset produced into Kafka, streamed (``train.data: kafka``) and read whole first (``train.data: memory``):
training samples/s of each with the same model, batch, world size and records, the last epoch of each run, in
shuffled rounds. The ratios are direct ÷ streamed and direct ÷ in-memory, measured in the same run."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rich.table import Table

from kbit_core.bench.training.train_bench import bench_config, fmt, median, ratio, run_settings, write_results
from kbit_core.brokers.local import embedded_broker
from kbit_core.config import KbitConfig
from kbit_core.data.dataset_reader import dataset_manifest
from kbit_core.datasets import open_source
from kbit_core.launch import launch
from kbit_core.produce import produce_dataset
from kbit_core.train.direct_worker import train_direct_main
from kbit_core.train.worker import train_main

RESULTS_FILE = "train_bench_direct.json"
MODES = ("direct", "kafka_stream", "memory")


def run_direct_bench(cfg: KbitConfig, *, output: Path | None = None, repeats: int = 1) -> dict[str, Any]:
    """Each of :data:`MODES` ``repeats`` times, in shuffled order; writes and returns the JSON."""
    base = bench_config(cfg)
    configs = {
        "direct": base.override({"train": {"data": "direct"}}),
        "kafka_stream": base.override({"train": {"data": "kafka"}, "reader": {"mode": "stream"}}),
        "memory": base.override({"train": {"data": "memory"}}),
    }
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    order = random.Random(cfg.bench.seed)
    with embedded_broker(base):
        topic = produce_dataset(base, progress=False).model_dump_json()
        manifests = {
            "direct": dataset_manifest(base, open_source(base.dataset, exact=True)).model_dump_json(),
            "kafka_stream": topic,
            "memory": topic,
        }
        for _ in range(repeats):
            modes = list(MODES)
            order.shuffle(modes)  # no measurement always runs first (cold caches) or last
            for mode in modes:
                entry = train_direct_main if mode == "direct" else train_main
                samples[mode].append(launch(entry, configs[mode], manifests[mode], str(base.run_dir)))
    speed = {mode: [run["samples_per_s"] for run in runs] for mode, runs in samples.items()}
    results = {
        "config": {**run_settings(base, base.produce.topic_for(base.dataset), repeats), "dataset": base.dataset.name},
        "direct": {
            **{f"{mode}_samples_per_s": speed[mode] for mode in MODES},
            **{f"{mode}_data_wait_fraction": [run["data_wait_fraction"] for run in samples[mode]] for mode in MODES},
            "direct_vs_kafka_stream": ratio(median(speed["direct"]), median(speed["kafka_stream"])),
            "direct_vs_memory": ratio(median(speed["direct"]), median(speed["memory"])),
        },
    }
    return write_results(results, output or Path(cfg.bench.output_dir).resolve() / RESULTS_FILE)


def direct_table(results: dict[str, Any]) -> Table:
    """Each mode's median samples/s and data wait, and direct's ratio to the two Kafka modes."""
    config, direct = results["config"], results["direct"]
    table = Table(
        title=f"{config['dataset']} read directly vs through Kafka ({config['world_size']} processes under "
        f"{config['launcher']}, {config['model']}, batch {config['global_batch_size']}, {config['repeats']} round(s))"
    )
    for column in ("mode", "samples/s", "data wait", "direct ÷ this"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode in MODES:
        vs = {"direct": None, "kafka_stream": "direct_vs_kafka_stream", "memory": "direct_vs_memory"}[mode]
        table.add_row(
            mode,
            fmt(median(direct[f"{mode}_samples_per_s"]), "{:,.0f}"),
            fmt(median(direct[f"{mode}_data_wait_fraction"]), "{:.0%}"),
            fmt(direct[vs], "{:.3f}x") if vs else "",
        )
    return table

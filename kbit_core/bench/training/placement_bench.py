"""Across hosts vs one host, measured in one run: call → first step and streamed samples/s of the same training.

The config names a cluster launch (``launch.master: spark://...``, ``local_mode: false``, e.g. the multi-host test
bed's ``deployments/train-cluster.yaml``). The baseline is the same config launched on this machine alone
(``local[N]``, local_mode, driver on loopback) reading the same topic from the same broker, so the ratio is the
price of placement (executors on other hosts, the barrier job, rendezvous over the network), not of the data.
Rounds alternate the order; each placement gets its own SparkSession, started off the clock of the first step
together with its executors (that start time is reported on its own).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from kbit_core.bench.training.train_bench import bench_config, fmt, launch_first_step, median, ratio
from kbit_core.brokers.local import embedded_broker
from kbit_core.config import KbitConfig
from kbit_core.launch import launch
from kbit_core.launch.spark import get_spark, stop_spark, wait_for_executors
from kbit_core.produce import produce_dataset
from kbit_core.train.worker import train_main

RESULTS_FILE = "placement_bench.json"


def local_placement(cfg: KbitConfig) -> KbitConfig:
    """``cfg`` launched on this machine only: local[N] with local_mode, the driver on loopback."""
    return cfg.override(
        {
            "launch": {
                "master": f"local[{cfg.launch.num_processes}]",
                "local_mode": True,
                "driver_host": "127.0.0.1",
                "driver_bind_address": "127.0.0.1",
                "executor_cores": None,
                "executor_memory": None,
            }
        }
    )


def run_placement_bench(cfg: KbitConfig, *, repeats: int = 1, output: Path | None = None) -> dict[str, Any]:
    """Measure both placements ``repeats`` times and write the JSON (``bench.output_dir/placement_bench.json``)."""
    placements = {"cluster": bench_config(cfg), "local": local_placement(bench_config(cfg))}
    session_start: dict[str, list[float]] = {name: [] for name in placements}
    first_step: dict[str, list[float]] = {name: [] for name in placements}
    samples_per_s: dict[str, list[float]] = {name: [] for name in placements}
    hosts: dict[str, list[str]] = {}
    order = random.Random(cfg.bench.seed)
    with embedded_broker(cfg):
        manifest_json = produce_dataset(placements["cluster"], progress=False).model_dump_json()
        for _ in range(repeats):
            names = list(placements)
            order.shuffle(names)
            for name in names:
                run_cfg = placements[name]
                stop_spark()  # one SparkSession per process: each placement starts its own, off the clock
                started = time.perf_counter()
                # A new application on a standalone cluster gets fresh executor JVMs: wait for them here too.
                wait_for_executors(get_spark(run_cfg), run_cfg.launch)
                session_start[name].append(time.perf_counter() - started)
                first_step[name].append(launch_first_step(run_cfg))
                result = launch(train_main, run_cfg, manifest_json, str(run_cfg.run_dir))
                samples_per_s[name].append(result["samples_per_s"])
                hosts[name] = sorted({rank["host"] for rank in result["ranks"]})
        stop_spark()
    results = {
        "config": {
            "master": cfg.launch.master,
            "world_size": cfg.launch.num_processes,
            "model": cfg.train.model.name,
            "variant": cfg.produce.variant.name,
            "num_records": cfg.dataset.num_records,
            "global_batch_size": cfg.train.global_batch_size,
            "bootstrap": cfg.kafka.resolved_bootstrap(),
            "security_protocol": cfg.kafka.security_protocol,
            "repeats": repeats,
        },
        "hosts": hosts,
        "session_start_s": session_start,
        "first_step_s": first_step,
        "samples_per_s": samples_per_s,
        "cluster_vs_local": {
            "session_start": ratio(median(session_start["cluster"]), median(session_start["local"])),
            "first_step": ratio(median(first_step["cluster"]), median(first_step["local"])),
            "samples_per_s": ratio(median(samples_per_s["cluster"]), median(samples_per_s["local"])),
        },
    }
    target = output or Path(cfg.bench.output_dir).resolve() / RESULTS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2))
    return {**results, "output": str(target)}


def placement_table(results: dict[str, Any]) -> Table:
    table = Table(
        title=f"placement benchmark ({results['config']['world_size']} ranks, "
        f"{results['config']['variant']}, {results['config']['repeats']} round(s))"
    )
    for column in ("measure", "local (one host)", "cluster", "cluster / local"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    ratios = results["cluster_vs_local"]
    table.add_row(
        "session + executors ready (s)",
        fmt(median(results["session_start_s"]["local"]), "{:.2f}"),
        fmt(median(results["session_start_s"]["cluster"]), "{:.2f}"),
        fmt(ratios["session_start"], "{:.2f}x"),
    )
    table.add_row(
        "call → first step (s)",
        fmt(median(results["first_step_s"]["local"]), "{:.2f}"),
        fmt(median(results["first_step_s"]["cluster"]), "{:.2f}"),
        fmt(ratios["first_step"], "{:.2f}x"),
    )
    table.add_row(
        "streamed samples/s",
        fmt(median(results["samples_per_s"]["local"]), "{:,.0f}"),
        fmt(median(results["samples_per_s"]["cluster"]), "{:,.0f}"),
        fmt(ratios["samples_per_s"], "{:.2f}x"),
    )
    table.caption = "hosts: " + "; ".join(f"{name}: {', '.join(h)}" for name, h in results["hosts"].items())
    return table

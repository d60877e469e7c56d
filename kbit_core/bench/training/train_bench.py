"""Training-path benchmark, every number measured in one run and reported as a ratio to its baseline.

* Kafka-streamed vs in-memory (eager) training samples/s: same model, batch, world size and data;
  the last epoch of each run counts (eager has its shard in memory by then). Target: >= 0.9x, for the
  config's variant and every other one asked for (``variants``: the same dataset, a topic each).
* Per launcher installed here (plain ``torchrun --standalone``; TorchDistributor with local_mode=True and
  local_mode=False; Ray Train's TorchTrainer): call -> first completed collective step, and Kafka-streamed
  training samples/s on the same model and topic, each against plain torchrun.
* DeepSpeed (ZeRO stage ``deepspeed.zero_stage``) vs DDP step time, both on in-memory data.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kbit_core.brokers.local import embedded_broker
from kbit_core.config import DataVariant, KbitConfig
from kbit_core.errors import ConfigError, DistributedError
from kbit_core.kafka.manifest import Manifest
from kbit_core.launch import launch
from kbit_core.launch.ray_train import ensure_ray
from kbit_core.launch.spark import get_spark
from kbit_core.produce import produce_dataset
from kbit_core.train.distributed import init_process_group, read_env, teardown
from kbit_core.train.worker import train_main

log = logging.getLogger(__name__)

STREAM_TARGET = 0.9
RESULTS_FILE = "train_bench.json"


def first_step_probe(cfg: KbitConfig, called_at: float) -> float:
    """Rank entry: join the process group, complete one all-reduce step, return seconds since ``called_at``."""
    # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
    import torch
    import torch.distributed as dist

    env = read_env(cfg.launch.use_gpu)
    init_process_group(env, cfg.launch.timeout_s)
    step = torch.ones(1, device=env.device)
    dist.all_reduce(step)
    elapsed = time.time() - called_at
    teardown()
    return elapsed


def run_train_bench(
    cfg: KbitConfig, *, output: Path | None = None, repeats: int = 1, variants: Sequence[DataVariant] = ()
) -> dict[str, Any]:
    """Measure everything in the module docstring ``repeats`` times (in shuffled order) and write the JSON."""
    base = bench_config(cfg)
    ds_name = f"deepspeed_zero{cfg.deepspeed.zero_stage}"
    stream = base.override({"train": {"data": "kafka"}, "reader": {"mode": "stream"}})
    trainings: dict[str, KbitConfig] = {
        "kafka_stream": stream,
        "memory": base.override({"train": {"data": "memory"}}),
        ds_name: base.override({"train": {"data": "memory"}, "deepspeed": {"enabled": True}}),
    }
    launchers = available_launchers(base)
    for name, launcher in launchers.items():
        if name != launcher_name(base):  # the base launcher's streamed run is kafka_stream itself
            trainings[f"{name}_stream"] = stream.override(launcher)
    launches = {
        name: functools.partial(launch_first_step, base.override(launcher)) for name, launcher in launchers.items()
    }
    other_variants = stream_variants(trainings, stream, variants)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trainings}
    overheads: dict[str, list[float | None]] = {name: [] for name in launches}
    order = random.Random(cfg.bench.seed)
    with embedded_broker(base):
        manifest, manifests = produce_topics(base, trainings, other_variants)
        _start_runtimes(base, launchers)
        with Progress(transient=True) as progress:
            task = progress.add_task("train bench", total=repeats * (len(trainings) + len(launches)))
            for round_no in range(repeats):
                names = [*trainings, *launches]
                order.shuffle(names)  # no measurement always runs first (cold caches) or last
                for name in names:
                    progress.update(task, description=f"train bench: {name} (round {round_no + 1}/{repeats})")
                    if name in trainings:
                        run_cfg = trainings[name]
                        samples[name].append(launch(train_main, run_cfg, manifests[name], str(base.run_dir)))
                    else:
                        overheads[name].append(_measure_launch(name, launches[name]))
                    progress.advance(task)
    results = _summarize(base, manifest.topic, ds_name, samples, overheads, repeats, other_variants)
    return write_results(results, output or Path(cfg.bench.output_dir).resolve() / RESULTS_FILE)


def stream_variants(
    trainings: dict[str, KbitConfig], stream: KbitConfig, variants: Sequence[DataVariant]
) -> list[DataVariant]:
    """Add a streamed training of each of ``variants`` other than ``stream``'s own to ``trainings``; returns those."""
    others = list({v.name: v for v in variants if v.name != stream.produce.variant.name}.values())
    for variant in others:
        trainings[stream_name(variant)] = stream.override({"produce": {"variant": variant.model_dump()}})
    return others


def produce_topics(
    cfg: KbitConfig, trainings: dict[str, KbitConfig], other_variants: Sequence[DataVariant]
) -> tuple[Manifest, dict[str, str]]:
    """Produce the config's topic and one per other variant; the config's manifest, and each training's as JSON."""
    manifest = produce_dataset(cfg, progress=False)
    manifests = {name: manifest.model_dump_json() for name in trainings}
    for variant in other_variants:
        manifests[stream_name(variant)] = produce_dataset(cfg, variant, progress=False).model_dump_json()
    return manifest, manifests


def write_results(results: dict[str, Any], target: Path) -> dict[str, Any]:
    """Write ``results`` as JSON to ``target`` and name it in them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2))
    results["output"] = str(target)
    return results


def stream_name(variant: DataVariant) -> str:
    """The measured mode that streams ``variant``'s topic under the config's launcher."""
    return f"kafka_stream_{variant.name}"


def available_launchers(cfg: KbitConfig) -> dict[str, dict[str, Any]]:
    """The launchers installed here that ``cfg`` can run under, as config overrides: plain torchrun always,
    TorchDistributor (local and cluster mode) where pyspark is, Ray Train where ray is."""
    launchers: dict[str, dict[str, Any]] = {"torchrun": {"launch": {"engine": "torchrun"}}}
    if installed("pyspark"):
        launchers["distributor_local_mode"] = {"launch": {"engine": "spark", "local_mode": True}}
        launchers["distributor_cluster_mode"] = {"launch": {"engine": "spark", "local_mode": False}}
    if installed("ray"):
        launchers["ray_train"] = {"launch": {"engine": "ray"}}
    usable = {}
    for name, launcher in launchers.items():
        try:
            cfg.override(launcher)
        except ConfigError as exc:  # e.g. cluster mode needs a barrier slot per process on the master
            log.warning("launcher %s not measured: %s", name, exc)
            continue
        usable[name] = launcher
    return usable


def launcher_name(cfg: KbitConfig) -> str:
    if cfg.launch.engine == "spark":
        return "distributor_local_mode" if cfg.launch.local_mode else "distributor_cluster_mode"
    return {"ray": "ray_train", "torchrun": "torchrun"}[cfg.launch.engine]


def _start_runtimes(cfg: KbitConfig, launchers: dict[str, dict[str, Any]]) -> None:
    """Start the SparkSession and Ray before measuring: a runtime's start is not a launch's overhead."""
    if any(name.startswith("distributor") for name in launchers):
        get_spark(cfg.override(launchers["distributor_local_mode"]))
    if "ray_train" in launchers:
        ensure_ray(cfg.override(launchers["ray_train"]))


def bench_config(cfg: KbitConfig) -> KbitConfig:
    """The user's config with at least two epochs (the last one is measured) and no checkpoint I/O in the timing."""
    return cfg.override(
        {
            "train": {"epochs": max(2, cfg.train.epochs)},
            "checkpoint": {"dir": None, "max_restarts": 0, "resume": "none"},
        }
    )


def _measure_launch(name: str, measure: Callable[[], float]) -> float | None:
    """One launch's call-to-first-step seconds; None (reported, not fatal) when that mode cannot run here."""
    try:
        return measure()
    except DistributedError as exc:
        log.warning("launch overhead %s not measured: %s", name, exc)
        return None


def launch_first_step(cfg: KbitConfig) -> float:
    """Call-to-first-step through the launcher ``launch.engine`` names."""
    return launch(first_step_probe, cfg, time.time())


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def median(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def run_settings(cfg: KbitConfig, topic: str, repeats: int) -> dict[str, Any]:
    """What the results were measured with."""
    return {
        "topic": topic,
        "world_size": cfg.launch.num_processes,
        "global_batch_size": cfg.train.global_batch_size,
        "model": cfg.train.model.name,
        "epochs": cfg.train.epochs,
        "num_records": cfg.dataset.num_records,
        "variant": cfg.produce.variant.name,
        "master": cfg.launch.master,
        "use_gpu": cfg.launch.use_gpu,
        "launcher": launcher_name(cfg),
        "precision": cfg.train.precision,
        "repeats": repeats,
    }


def by_variant(
    cfg: KbitConfig,
    speed: dict[str, list[float]],
    samples: dict[str, list[dict[str, Any]]],
    other_variants: Sequence[DataVariant],
) -> dict[str, dict[str, Any]]:
    """Each streamed variant's throughput and its ratio to the in-memory baseline."""
    measured = {}
    for variant, name in ((cfg.produce.variant, "kafka_stream"), *((v, stream_name(v)) for v in other_variants)):
        vs_memory = ratio(median(speed[name]), median(speed["memory"]))
        measured[variant.name] = {
            "samples_per_s": speed[name],
            "data_wait_fraction": [r["data_wait_fraction"] for r in samples[name]],
            "vs_memory": vs_memory,
            "meets_target": vs_memory is not None and vs_memory >= STREAM_TARGET,
        }
    return measured


def _summarize(
    cfg: KbitConfig,
    topic: str,
    ds_name: str,
    samples: dict[str, list[dict[str, Any]]],
    overheads: dict[str, list[float | None]],
    repeats: int,
    other_variants: Sequence[DataVariant] = (),
) -> dict[str, Any]:
    speed = {name: [r["samples_per_s"] for r in runs] for name, runs in samples.items()}
    step_time = {name: [cfg.train.global_batch_size / s for s in speed[name] if s] for name in ("memory", ds_name)}
    kafka_vs_memory = ratio(median(speed["kafka_stream"]), median(speed["memory"]))
    by_launcher = {
        name: speed["kafka_stream" if name == launcher_name(cfg) else f"{name}_stream"] for name in overheads
    }
    torchrun = median(overheads["torchrun"])
    return {
        "config": run_settings(cfg, topic, repeats),
        "throughput": {
            "kafka_stream_samples_per_s": speed["kafka_stream"],
            "memory_samples_per_s": speed["memory"],
            "kafka_stream_data_wait_fraction": [r["data_wait_fraction"] for r in samples["kafka_stream"]],
            "kafka_vs_memory": kafka_vs_memory,
            "target": STREAM_TARGET,
            "meets_target": kafka_vs_memory is not None and kafka_vs_memory >= STREAM_TARGET,
        },
        "stream_by_variant": by_variant(cfg, speed, samples, other_variants),
        "stream_samples_per_s_by_launcher": {
            **by_launcher,
            "vs_torchrun": {
                name: ratio(median(values), median(by_launcher["torchrun"]))
                for name, values in by_launcher.items()
                if name != "torchrun"
            },
        },
        "launch_overhead_s": {
            **overheads,
            "vs_torchrun": {
                name: ratio(median(values), torchrun) for name, values in overheads.items() if name != "torchrun"
            },
        },
        "step_time_s": {
            "ddp": step_time["memory"],
            ds_name: step_time[ds_name],
            "deepspeed_vs_ddp": ratio(median(step_time[ds_name]), median(step_time["memory"])),
            "final_loss": {
                "ddp": [r["loss_curve"][-1] for r in samples["memory"] if r["loss_curve"]],
                ds_name: [r["loss_curve"][-1] for r in samples[ds_name] if r["loss_curve"]],
            },
        },
    }


def results_table(results: dict[str, Any]) -> Table:
    """Medians and ratios as one rich table."""
    config = results["config"]
    device = "GPU" if config["use_gpu"] else "CPU"
    table = Table(
        title=f"training benchmark ({config['world_size']} {device} processes under {config['launcher']}, "
        f"{config['variant']}, {config['repeats']} round(s))"
    )
    for column in ("measure", "median", "ratio", "baseline"):
        table.add_column(column, justify="left" if column in ("measure", "baseline") else "right")
    thr, launch, steps = results["throughput"], results["launch_overhead_s"], results["step_time_s"]
    verdict = "[green]meets[/]" if thr["meets_target"] else "[red]below[/]"
    table.add_row(
        "samples/s kafka stream",
        fmt(median(thr["kafka_stream_samples_per_s"]), "{:,.0f}"),
        fmt(thr["kafka_vs_memory"], "{:.3f}x"),
        f"in-memory; target {thr['target']}x {verdict}",
    )
    table.add_row("samples/s in memory", fmt(median(thr["memory_samples_per_s"]), "{:,.0f}"), "1.000x", "")
    for variant, streamed in results["stream_by_variant"].items():
        if variant != config["variant"]:
            add_variant_row(table, variant, streamed, thr["target"])
    by_launcher = results["stream_samples_per_s_by_launcher"]
    table.add_row(
        "samples/s kafka stream, plain torchrun", fmt(median(by_launcher["torchrun"]), "{:,.0f}"), "1.000x", ""
    )
    for name, ratio_ in by_launcher["vs_torchrun"].items():
        table.add_row(
            f"samples/s kafka stream, {name}",
            fmt(median(by_launcher[name]), "{:,.0f}"),
            fmt(ratio_, "{:.3f}x"),
            "plain torchrun",
        )
    table.add_row("first step, plain torchrun (s)", fmt(median(launch["torchrun"]), "{:.2f}"), "1.000x", "")
    for name, ratio_ in launch["vs_torchrun"].items():
        table.add_row(
            f"first step, {name} (s)", fmt(median(launch[name]), "{:.2f}"), fmt(ratio_, "{:.2f}x"), "plain torchrun"
        )
    ds_name = next(k for k in steps if k.startswith("deepspeed_zero"))
    table.add_row("step time DDP (ms)", fmt(_ms(median(steps["ddp"])), "{:.1f}"), "1.000x", "")
    table.add_row(
        f"step time {ds_name} (ms)",
        fmt(_ms(median(steps[ds_name])), "{:.1f}"),
        fmt(steps["deepspeed_vs_ddp"], "{:.2f}x"),
        "DDP",
    )
    return table


def add_variant_row(table: Table, variant: str, streamed: dict[str, Any], target: float) -> None:
    """A streamed variant's median samples/s, its ratio to in-memory and the verdict."""
    verdict = "[green]meets[/]" if streamed["meets_target"] else "[red]below[/]"
    table.add_row(
        f"samples/s kafka stream, {variant}",
        fmt(median(streamed["samples_per_s"]), "{:,.0f}"),
        fmt(streamed["vs_memory"], "{:.3f}x"),
        f"in-memory; target {target}x {verdict}",
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)

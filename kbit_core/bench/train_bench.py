"""Training-path benchmark, every number measured in one run and reported as a ratio to its baseline.

* Kafka-streamed vs in-memory (eager) training samples/s: same model, batch, world size and data;
  the last epoch of each run counts (eager has its shard in memory by then). Target: >= 0.9x.
* Launch overhead, from the driver's call to the first completed collective step: TorchDistributor
  with local_mode=True and local_mode=False and Ray Train's TorchTrainer next to plain ``torchrun --standalone``.
* Ray Train vs TorchDistributor Kafka-streamed training samples/s (the same entry, model and topic).
* DeepSpeed (ZeRO stage ``deepspeed.zero_stage``) vs DDP step time, both on in-memory data.

Run as ``python -m torch.distributed.run ... -m kbit_core.bench.train_bench OUT CALLED_AT USE_GPU``,
this module is the plain-torchrun side of the launch-overhead measurement.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kbit_core.config import KbitConfig
from kbit_core.errors import DistributedError
from kbit_core.launch import launch

log = logging.getLogger(__name__)

STREAM_TARGET = 0.9
RESULTS_FILE = "train_bench.json"


def first_step_probe(cfg: KbitConfig, called_at: float) -> float:
    """The rank entry of the TorchDistributor launch measurements (see :func:`first_step`)."""
    return first_step(called_at, cfg.launch.use_gpu, cfg.launch.timeout_s)


def first_step(called_at: float, use_gpu: bool, timeout_s: int) -> float:
    """Join the process group, complete one all-reduce step, and return seconds since ``called_at`` (wall clock)."""
    import torch
    import torch.distributed as dist

    from kbit_core.train.distributed import init_process_group, read_env, teardown

    env = read_env(use_gpu)
    init_process_group(env, timeout_s)
    step = torch.ones(1, device=env.device)
    dist.all_reduce(step)
    elapsed = time.time() - called_at
    teardown()
    return elapsed


def run_train_bench(cfg: KbitConfig, *, output: Path | None = None, repeats: int = 1) -> dict[str, Any]:
    """Measure everything in the module docstring ``repeats`` times (in shuffled order) and write the JSON."""
    from kbit_core.kafka.producer import produce_dataset
    from kbit_core.launch.spark import get_spark
    from kbit_core.kafka.broker import embedded_broker
    from kbit_core.train.worker import train_main

    base = bench_config(cfg).override({"launch.engine": "spark"})  # Ray Train is measured by name below
    ds_name = f"deepspeed_zero{cfg.deepspeed.zero_stage}"
    trainings: dict[str, KbitConfig] = {
        "kafka_stream": base.override({"train": {"data": "kafka"}, "reader": {"mode": "stream"}}),
        "memory": base.override({"train": {"data": "memory"}}),
        ds_name: base.override({"train": {"data": "memory"}, "deepspeed": {"enabled": True}}),
    }
    launches: dict[str, Callable[[], float]] = {
        "torchrun": lambda: _torchrun_first_step(base),
        "distributor_local_mode": lambda: launch_first_step(base.override({"launch": {"local_mode": True}})),
        "distributor_cluster_mode": lambda: launch_first_step(base.override({"launch": {"local_mode": False}})),
    }
    on_ray = base.override({"launch": {"engine": "ray"}})
    if ray_installed():
        trainings["ray_train_stream"] = trainings["kafka_stream"].override({"launch": {"engine": "ray"}})
        launches["ray_train"] = lambda: launch_first_step(on_ray)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trainings}
    overheads: dict[str, list[float | None]] = {name: [] for name in launches}
    order = random.Random(cfg.bench.seed)
    with embedded_broker(base):
        manifest = produce_dataset(base, progress=False)
        manifest_json = manifest.model_dump_json()
        get_spark(base)
        if ray_installed():
            from kbit_core.launch.ray_train import ensure_ray

            ensure_ray(on_ray)  # like the SparkSession above: the runtime's start is not a launch's overhead
        with Progress(transient=True) as progress:
            task = progress.add_task("train bench", total=repeats * (len(trainings) + len(launches)))
            for round_no in range(repeats):
                names = [*trainings, *launches]
                order.shuffle(names)  # no measurement always runs first (cold caches) or last
                for name in names:
                    progress.update(task, description=f"train bench: {name} (round {round_no + 1}/{repeats})")
                    if name in trainings:
                        run_cfg = trainings[name]
                        samples[name].append(launch(train_main, run_cfg, manifest_json, str(base.run_dir)))
                    else:
                        overheads[name].append(_measure_launch(name, launches[name]))
                    progress.advance(task)
    results = _summarize(base, manifest.topic, ds_name, samples, overheads, repeats)
    target = output or Path(cfg.bench.output_dir).resolve() / RESULTS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2))
    results["output"] = str(target)
    return results


def bench_config(cfg: KbitConfig) -> KbitConfig:
    """The user's config with at least two epochs (the last one is measured) and no checkpoint I/O in the timing."""
    return cfg.override({"train": {"epochs": max(2, cfg.train.epochs)},
                       "checkpoint": {"dir": None, "max_restarts": 0, "resume": "none"}})


def _measure_launch(name: str, measure: Callable[[], float]) -> float | None:
    """One launch's call-to-first-step seconds; None (reported, not fatal) when that mode cannot run here."""
    try:
        return measure()
    except DistributedError as exc:
        log.warning("launch overhead %s not measured: %s", name, exc)
        return None


def launch_first_step(cfg: KbitConfig) -> float:
    """Call-to-first-step through the engine ``launch.engine`` names (TorchDistributor or Ray Train)."""
    return launch(first_step_probe, cfg, time.time())


def ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _torchrun_first_step(cfg: KbitConfig) -> float:
    """Plain ``torchrun --standalone`` running :func:`first_step_probe` (through this module's ``__main__``)."""
    scratch = Path(tempfile.mkdtemp(prefix="kbit-torchrun-", dir=cfg.run_dir))
    out = scratch / "first_step.json"
    env = {**os.environ, "TMPDIR": str(scratch)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc_per_node={cfg.launch.num_processes}", "-m", __name__, str(out), repr(time.time()),
           str(int(cfg.launch.use_gpu)), str(cfg.launch.timeout_s)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cfg.launch.timeout_s)
        if done.returncode != 0 or not out.is_file():
            raise DistributedError(f"plain torchrun probe failed (exit {done.returncode}): {done.stdout[-2000:]}"
                                   f"{done.stderr[-2000:]}")
        return json.loads(out.read_text())["first_step_s"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def median(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _summarize(cfg: KbitConfig, topic: str, ds_name: str, samples: dict[str, list[dict[str, Any]]],
               overheads: dict[str, list[float | None]], repeats: int) -> dict[str, Any]:
    speed = {name: [r["samples_per_s"] for r in runs] for name, runs in samples.items()}
    step_time = {name: [cfg.train.global_batch_size / s for s in speed[name] if s] for name in ("memory", ds_name)}
    kafka_vs_memory = ratio(median(speed["kafka_stream"]), median(speed["memory"]))
    torchrun = median(overheads["torchrun"])
    return {
        "config": {
            "topic": topic, "world_size": cfg.launch.num_processes, "global_batch_size": cfg.train.global_batch_size,
            "model": cfg.train.model.name, "epochs": cfg.train.epochs, "num_records": cfg.dataset.num_records,
            "variant": cfg.produce.variant.name, "master": cfg.launch.master, "use_gpu": cfg.launch.use_gpu,
            "repeats": repeats,
        },
        "throughput": {
            "kafka_stream_samples_per_s": speed["kafka_stream"],
            "memory_samples_per_s": speed["memory"],
            "kafka_stream_data_wait_fraction": [r["data_wait_fraction"] for r in samples["kafka_stream"]],
            "kafka_vs_memory": kafka_vs_memory,
            "ray_train_stream_samples_per_s": speed.get("ray_train_stream", []),
            "ray_train_vs_distributor": ratio(median(speed.get("ray_train_stream", [])), median(speed["kafka_stream"])),
            "target": STREAM_TARGET,
            "meets_target": kafka_vs_memory is not None and kafka_vs_memory >= STREAM_TARGET,
        },
        "launch_overhead_s": {
            **overheads,
            "vs_torchrun": {name: ratio(median(values), torchrun) for name, values in overheads.items()
                            if name != "torchrun"},
        },
        "step_time_s": {
            "ddp": step_time["memory"],
            ds_name: step_time[ds_name],
            "deepspeed_vs_ddp": ratio(median(step_time[ds_name]), median(step_time["memory"])),
            "final_loss": {"ddp": [r["loss_curve"][-1] for r in samples["memory"] if r["loss_curve"]],
                           ds_name: [r["loss_curve"][-1] for r in samples[ds_name] if r["loss_curve"]]},
        },
    }


def results_table(results: dict[str, Any]) -> Table:
    """Medians and ratios as one rich table."""
    table = Table(title=f"training benchmark ({results['config']['world_size']} processes, "
                        f"{results['config']['variant']}, {results['config']['repeats']} round(s))")
    for column in ("measure", "median", "ratio", "baseline"):
        table.add_column(column, justify="left" if column in ("measure", "baseline") else "right")
    thr, launch, steps = results["throughput"], results["launch_overhead_s"], results["step_time_s"]
    verdict = "[green]meets[/]" if thr["meets_target"] else "[red]below[/]"
    table.add_row("samples/s kafka stream", fmt(median(thr["kafka_stream_samples_per_s"]), "{:,.0f}"),
                  fmt(thr["kafka_vs_memory"], "{:.3f}x"), f"in-memory; target {thr['target']}x {verdict}")
    table.add_row("samples/s in memory", fmt(median(thr["memory_samples_per_s"]), "{:,.0f}"), "1.000x", "")
    table.add_row("samples/s kafka stream, Ray Train", fmt(median(thr["ray_train_stream_samples_per_s"]), "{:,.0f}"),
                  fmt(thr["ray_train_vs_distributor"], "{:.3f}x"), "kafka stream under TorchDistributor")
    table.add_row("first step, plain torchrun (s)", fmt(median(launch["torchrun"]), "{:.2f}"), "1.000x", "")
    for name, ratio in launch["vs_torchrun"].items():
        table.add_row(f"first step, {name} (s)", fmt(median(launch[name]), "{:.2f}"), fmt(ratio, "{:.2f}x"),
                      "plain torchrun")
    ds_name = next(k for k in steps if k.startswith("deepspeed_zero"))
    table.add_row("step time DDP (ms)", fmt(_ms(median(steps["ddp"])), "{:.1f}"), "1.000x", "")
    table.add_row(f"step time {ds_name} (ms)", fmt(_ms(median(steps[ds_name])), "{:.1f}"),
                  fmt(steps["deepspeed_vs_ddp"], "{:.2f}x"), "DDP")
    return table


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


if __name__ == "__main__":
    out_path, called_at, use_gpu, timeout_s = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    first_step_s = first_step(called_at, use_gpu, timeout_s)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_path).write_text(json.dumps({"first_step_s": first_step_s}))

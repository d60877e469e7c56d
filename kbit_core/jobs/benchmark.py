"""The benchmark protocol: the experiment matrix, warm-up plus measured iterations, reports and tracking.

One iteration is one launcher job per world size and engine (TorchDistributor, Ray Train or torchrun: fresh worker
processes, as in the original) that runs every configuration once, in an order shuffled per iteration from
``(bench.seed, iteration)`` so broker caches and neighbour noise hit all configurations alike. Warm-up
iterations run the same way and are recorded but excluded from every statistic. Topic production and the job
launch stay off the clock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kbit_core import testbed
from kbit_core.bench.loading.measure import Sample, Task, measure_iteration
from kbit_core.bench.loading.report import ReportFiles, load_stats, timings_frame, write_report
from kbit_core.brokers.local import embedded_broker
from kbit_core.config import LOOPBACK, DataVariant, KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.jobs.preflight import check_benchmark
from kbit_core.kafka.manifest import manifest_path
from kbit_core.launch import launch
from kbit_core.produce import ensure_topics
from kbit_core.testbed.shaping import network_shape
from kbit_core.topic_dataset import snapshot_dataset, snapshot_variant
from kbit_core.tracking import make_tracker, run_environment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix: a data variant read with one client at one batch and world size, launched by
    one engine."""

    variant: DataVariant
    client: str
    batch_size: int
    world_size: int
    name: str
    engine: str = "spark"
    decoder: str = "fast"
    network: str = LOOPBACK


def matrix(cfg: KbitConfig) -> list[Cell]:
    """variants × clients × decoders × batch sizes × world sizes × engines × networks; names stay short when a sweep
    has one value.

    The client is always part of the name (``avro_list_lz4.confluent``); ``.<decoder>``/``.b<N>``/``.w<N>``/
    ``.<engine>``/``@<network>`` appear only when bench.decoders / batch_sizes / world_sizes / engines / networks
    are set, so names are stable across runs of one profile.
    """
    b = cfg.bench
    batch_sizes = b.batch_sizes or [cfg.train.global_batch_size]
    world_sizes = b.world_sizes or [cfg.launch.num_processes]
    engines = b.engines or [cfg.launch.engine]
    decoders = b.decoders or [cfg.reader.decoder]
    networks = b.networks or [LOOPBACK]
    for i, network in enumerate(networks):
        network_shape(network, where=f"bench.networks[{i}]")  # refuses a bad name before anything runs
    cells = []
    for engine, ws in itertools.product(engines, world_sizes):
        for bs in batch_sizes:
            if bs < ws:
                raise ConfigError(f"bench.batch_sizes has {bs}, smaller than world size {ws}")
            for network, variant, client, decoder in itertools.product(
                networks, b.matrix_variants(), b.clients, decoders
            ):
                name = f"{variant.name}.{client}"
                name += f".{decoder}" if b.decoders else ""
                name += f".b{bs}" if b.batch_sizes else ""
                name += f".w{ws}" if b.world_sizes else ""
                name += f".{engine}" if b.engines else ""
                name += f"@{network}" if b.networks else ""
                cells.append(Cell(variant, client, bs, ws, name, engine, decoder, network))
    names = [c.name for c in cells]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"bench matrix repeats configuration(s) {duplicates}; remove duplicate variants/clients")
    return cells


def iteration_order(cfg: KbitConfig, cells: list[Cell], index: int) -> list[Cell]:
    """The cells in the order iteration ``index`` (0-based over warm-up and measured) runs them."""
    if not cfg.bench.shuffle_order:
        return list(cells)
    rng = np.random.default_rng([cfg.bench.seed, index])
    return [cells[i] for i in rng.permutation(len(cells))]


@dataclass(frozen=True)
class BenchResult:
    run_id: str
    report_dir: Path
    files: ReportFiles
    stats: dict[str, Any]
    parent_run_id: str | None
    child_run_ids: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        """Stats and raw samples per configuration and the path of every report file (``kbit bench --json``)."""
        s = self.stats
        return {
            "run_id": self.run_id,
            "report_dir": str(self.report_dir),
            "files": self.files.to_dict(),
            "mlflow": {"parent_run_id": self.parent_run_id, "child_run_ids": self.child_run_ids},
            "configurations": {
                name: {
                    "load_time": s["statistical_analysis"][name],
                    "makespan": s["makespan"]["statistical_analysis"][name],
                    "raw_load_s": s["raw_results"][name],
                    "raw_makespan_s": s["makespan"]["raw_results"][name],
                    "throughput": s["throughput"][name],
                    "stages": s["stages"][name],
                    "counters": s["counters"][name],
                    **({"training": s["training"][name]} if name in s.get("training", {}) else {}),
                }
                for name in s["statistical_analysis"]
            },
            "comparison": s["comparison"],
            "metadata": s["metadata"],
        }


@contextlib.contextmanager
def shaped_bed(cfg: KbitConfig) -> Iterator[Callable[[str], None]]:
    """A function that shapes the test bed's links to a network profile, when bench.networks is set; the links
    are put back as they were at the end. Without bench.networks the links stay as they are (nothing is needed)."""
    if not cfg.bench.networks:
        yield lambda network: None
        return
    bed_dir = testbed.running_bed_dir()
    state = testbed.load_state(bed_dir) if bed_dir else None
    if bed_dir is None or state is None:
        raise ConfigError("bench.networks shapes the test bed's links: bring it up first (`kbit cluster up`)")

    def shape(network: str) -> None:
        link = network_shape(network)
        testbed.reshape(bed_dir, link and link.spec())
        log.info("bed links shaped for network %s", network)

    try:
        yield shape
    finally:
        testbed.reshape(bed_dir, state.options.get("link"))


def run_iterations(cfg: KbitConfig, cells: list[Cell], manifests: dict[str, str], *, progress: bool) -> list[dict]:
    """Per network (the bed's links shaped to it), warm-up then measured iterations, one job per iteration, world
    size and engine; all raw rows.

    Every engine runs the same measurement function (``measure_iteration``) on the same tasks. Each job opens its
    connections after the links were shaped.
    """
    b = cfg.bench
    launchers = sorted({(c.world_size, c.engine) for c in cells})
    networks = list(dict.fromkeys(c.network for c in cells))
    iterations = range(b.warmup_iterations + b.iterations)
    jobs = [(net, i, ws, engine) for net in networks for i in iterations for ws, engine in launchers]
    rows: list[dict[str, Any]] = []
    with (
        Progress(
            TextColumn("[bold]bench[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
        ) as bar,
        shaped_bed(cfg) as shape,
    ):
        task = bar.add_task("", total=len(jobs))
        shaped = None
        for network, index, ws, engine in jobs:
            if network != shaped:
                shape(shaped := network)
            iteration = index - b.warmup_iterations
            label = f"warm-up {index + 1}" if iteration < 0 else f"iteration {iteration + 1}/{b.iterations}"
            bar.update(task, description=f"{label} (world size {ws}, {engine}, {network})")
            order = [
                c
                for c in iteration_order(cfg, cells, index)
                if (c.world_size, c.engine, c.network) == (ws, engine, network)
            ]
            tasks = [
                asdict(Task(c.name, c.client, c.batch_size, manifests[c.name], c.decoder, c.network)) for c in order
            ]
            job_cfg = cfg.override({"launch.num_processes": ws, "launch.engine": engine})
            samples = launch(
                measure_iteration, job_cfg, tasks, iteration, iteration < 0, b.train_epoch, result_type=list[Sample]
            )
            rows += [asdict(sample) for sample in samples]
            bar.advance(task)
    return rows


def network_rates(networks: list[str]) -> dict[str, int | None]:
    """Each network profile's link rate in bit/s (None: unshaped), for the report's network section."""
    return {n: shape.rate_bit_s if (shape := network_shape(n)) else None for n in networks}


def run_benchmark(cfg: KbitConfig, *, progress: bool = True) -> BenchResult:
    """Produce missing topics, run warm-up + measured iterations, write the report, track it in MLflow.

    The embedded broker is started for the run when the config uses it and nothing listens there yet.
    Reports go to ``bench.output_dir/<UTC timestamp>/``.
    """
    if cfg.source.topic is not None:  # a user's topic: its snapshot is the one "variant" measured
        cfg = cfg.override({"bench.variants": [snapshot_variant(cfg).model_dump()], "bench.records_per_message": None})
    cells = matrix(cfg)
    for warning in check_benchmark(cfg).warnings if cfg.source.topic is None else ():
        log.warning("%s", warning)
    started_at = datetime.now(UTC)
    run_id = started_at.strftime("%Y%m%dT%H%M%SZ")
    report_dir = Path(cfg.bench.output_dir).resolve() / run_id
    b = cfg.bench
    with embedded_broker(cfg):
        variants = list({c.variant.name: c.variant for c in cells}.values())
        # check_benchmark checked every variant's topic
        produced = (
            {variants[0].name: snapshot_dataset(cfg)}
            if cfg.source.topic is not None
            else dict(zip((v.name for v in variants), ensure_topics(cfg, variants, progress=progress, checked=True)))
        )
        manifests = [produced[c.variant.name] for c in cells]
        tracker = make_tracker(cfg)
        with tracker.run(cfg, name=f"bench-{run_id}", kind="benchmark", tags={"suite": cfg.profile}) as parent_id:
            rows = run_iterations(
                cfg, cells, {c.name: m.model_dump_json() for c, m in zip(cells, manifests)}, progress=progress
            )
            world_sizes = sorted({c.world_size for c in cells})
            metadata = {
                "run_id": run_id,
                "timestamp": started_at.isoformat(),
                "profile": cfg.profile,
                "iterations": b.iterations,
                "warmup": b.warmup_iterations,
                "world_size": world_sizes[0] if len(world_sizes) == 1 else world_sizes,
                "shuffle_order": b.shuffle_order,
                "seed": b.seed,
                "launch": cfg.launch.model_dump(mode="json"),
                "dataset": cfg.dataset.model_dump(mode="json"),
                "partitions": cfg.produce.partitions,
                **({"networks": network_rates(b.networks)} if b.networks else {}),
                "topics": {c.name: m.topic for c, m in zip(cells, manifests)},
                "wire_bytes_per_record": {
                    c.name: m.wire_bytes / m.num_records
                    for c, m in zip(cells, manifests)
                    if m.wire_bytes is not None and m.num_records
                },
                "mlflow_run_id": parent_id,
                **run_environment(cfg),
            }
            files = write_report(
                timings_frame(rows), metadata, report_dir, bootstrap_resamples=b.bootstrap_resamples, seed=b.seed
            )
            stats = load_stats(files.stats_json)
            manifest_paths = [manifest_path(cfg.workdir, m.topic) for m in produced.values()]
            children = tracker.log_benchmark(parent_id, stats, rows, [*files.paths(), *manifest_paths])
    log.info("benchmark %s: report in %s", run_id, report_dir)
    return BenchResult(run_id, report_dir, files, stats, parent_id, children)

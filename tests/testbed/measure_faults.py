"""The fault table of docs/reliability.md: batch DDP training on the running test bed (train-cluster: one rank per
node host, TLS + SCRAM to the three brokers, RF 3, min.insync.replicas=2) once undisturbed and once per operator's
fault (kbit_core.testbed.faults, disk_faults, and the rolling upgrade of kbit_core.testbed.upgrade, last: it leaves the bed on
the new release), fired from the driver host when rank 0 reaches a step.

Each row: the job's outcome, its extra wall time, the longest wait between two steps of any rank (the stall) against
the undisturbed run's, and whether the weights and the loss curve equal the undisturbed run's (``torch.equal``: no
record lost, none trained twice, in the same order). Run as root with the bed up (`kbit cluster up`):
``python -m tests.testbed.measure_faults [FAULT ...] [--records N] [--at-step K] [--cut-off-s S] [--step-s T]``
(each step at least T seconds: the run spans the fault; 25 steps of the 2,000 records take ~2 s unstretched); prints
one JSON object per run. ``--produce``: instead of training, produces of ``--records`` records each, one
after another for as long as each fault lasts (fired as the first begins), against one undisturbed produce; each
topic is then read back (records lost: indices missing; twice: indices read more than once). ``--stream``: continuous
training on a stream kbit's live producer writes at ``--rate`` records a second until ``--records``
(tests/testbed/stream_workload.py), audited by the stream ledger: every acknowledged record trained once.
``--client confluent|kafka-python``: the workload's Kafka client (the ranks' reader and every producer; with
``--stream`` the live producer only: continuous training reads with confluent-kafka); each row names it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kbit_core import testbed as bed
from kbit_core.kafka import contents
from kbit_core.produce import produce_dataset
from kbit_core.testbed import disk_faults, faults, upgrade
from kbit_core.train import checkpoint as ckpt
from tests.conftest import FAULT_MODELS_DIR, REPO
from tests.faults.test_fault_replicated import _read_indices
from tests.testbed.fault_firing import ALL_FAULTS, FaultAtStep, end_measuring, exit_on_sigterm, fire
from tests.testbed.stream_workload import longest_step_wait, run_stream
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, bed_sets, run_kbit
from tests.testbed.test_secured_kafka import bed_config


def client_sets(client: str) -> dict[str, str]:
    """The config overrides that make ``client`` the workload's Kafka client: the ranks' reader and the producer."""
    return {"kafka.client": client, "produce.client": client}


def user_sets(args: argparse.Namespace) -> list[str]:
    """``--set`` arguments of the workload's kbit config from ``--set KEY=VALUE`` (last, so they win)."""
    return [arg for key_value in args.set for arg in ("--set", key_value)]


def train(
    state: bed.BedState, workdir: Path, topic: str, args: argparse.Namespace, step_s: float, command: str = "train"
) -> tuple[dict[str, Any], float, float, int]:
    """One train-cluster run of ``args.records`` records on ``topic`` (or with ``command`` produce, its topic only)
    with Kafka client ``args.client`` and ``args.set``: its result (the error's tail when it failed), wall seconds,
    longest step wait, rc."""
    clock_dir = workdir / "clock"
    clock_dir.mkdir(parents=True)
    model = {"name": "fault_models:step_clock", "kwargs": {"clock_dir": str(clock_dir), "step_s": step_s}}
    extra = {
        "dataset.num_records": args.records,
        "train.epochs": 1,
        "tracking.enabled": False,
        "train.model": model,
        "launch.spark_conf": {"spark.executorEnv.PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
        **client_sets(args.client),
    }
    sets = [*bed_sets(state, workdir, **extra), "--set", f"produce.topic={topic}", *user_sets(args)]
    started = time.monotonic()
    done = run_kbit(
        command, "--config", str(TRAIN_CLUSTER), "--json", *sets, env={"PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"}
    )
    result = json.loads(done.stdout) if done.returncode == 0 else {"stderr": done.stderr[-2000:]}
    return result, time.monotonic() - started, longest_step_wait(clock_dir), done.returncode


def _same_weights(a: dict, b: dict) -> bool:
    ours, theirs = (ckpt.read_file(Path(r["checkpoint"]))[ckpt.MODEL] for r in (a, b))
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _produce_once(state: bed.BedState, workdir: Path, topic: str, args: argparse.Namespace) -> dict[str, Any]:
    """One produce of ``args.records`` records into a new ``topic`` with ``args.client`` and ``args.set``, timed,
    then read back with it: lost and twice-read indices."""
    records = args.records
    over = [f"{key}={value}" for key, value in client_sets(args.client).items()]
    cfg = bed_config(state, workdir, f"dataset.num_records={records}", f"produce.topic={topic}", *over, *args.set)
    started = time.monotonic()
    try:
        manifest = produce_dataset(cfg, progress=False)
    except Exception as exc:  # the row says how it failed
        return {"seconds": round(time.monotonic() - started, 1), "error": (str(exc) or repr(exc)).splitlines()[0][:300]}
    seconds = time.monotonic() - started
    read = _read_indices(cfg, manifest)
    return {
        "seconds": round(seconds, 1),
        "exact": contents.check_topic(cfg.kafka, manifest).holds_manifest,
        "lost": len(set(range(records)) - set(read)),
        "twice": len(read) - len(set(read)),
    }


def produce_row(state: bed.BedState, brokers: faults.BedBrokers, name: str, workdir: Path, args, topic: str) -> dict:
    """Produces one after another while fault ``name`` runs (fired as the first begins, on the leader of ``topic``'s
    partition 0 where it takes one broker); the row for them."""
    fault = FaultAtStep(workdir / "start", 0, name, brokers, topic, args.cut_off_s)
    runs: list[dict[str, Any]] = []
    while fault.is_alive() or not runs:
        topic_n = f"kbit-bed-produce-{workdir.name}-{len(runs)}"
        runs.append(_produce_once(state, workdir, topic_n, args))
    fault.join()
    return {
        "run": name,
        "workload": "produce",
        "produces": len(runs),
        "failed": [r["error"] for r in runs if "error" in r],
        "longest_produce_s": max(r["seconds"] for r in runs),
        "lost": sum(r.get("lost", 0) for r in runs),
        "twice": sum(r.get("twice", 0) for r in runs),
        "all_exact": all(r.get("exact") for r in runs),
        "fault": fault.row(),
    }


def stream_row(state, brokers, name: str, workdir: Path, args, clean: dict) -> dict:
    """Continuous training on a live stream with fault ``name`` fired when rank 0 reaches ``args.at_step`` (on the
    leader of the stream's partition 0 where it takes one broker); the row for it."""
    row = run_stream(
        state,
        workdir,
        args.records,
        rate=args.rate,
        step_s=args.step_s,
        client=args.client,
        at_step=args.at_step,
        fire=lambda topic: fire(name, brokers, topic, args.cut_off_s),
        sets=user_sets(args),
    )
    extra = {"extra_s": round(row["seconds"] - clean["seconds"], 1), "undisturbed_stall_s": clean["stall_s"]}
    return {"run": name, "workload": "stream", **row, **extra}


def train_row(state, brokers, name: str, workdir: Path, args, topic: str, clean: dict, clean_s: float) -> dict:
    """One training run with fault ``name`` fired when rank 0 reaches ``args.at_step``; the row for it."""
    fault = FaultAtStep(workdir / "clock" / "rank-0", args.at_step, name, brokers, topic, args.cut_off_s)
    result, seconds, wait, rc = train(state, workdir, topic, args, args.step_s)
    fault.join()
    row = {
        "run": name,
        "rc": rc,
        "seconds": round(seconds, 1),
        "extra_s": round(seconds - clean_s, 1),
        "stall_s": round(wait, 2),
        "same_weights": rc == 0 and _same_weights(result, clean),
        "same_loss_curve": rc == 0 and result["loss_curve"] == clean["loss_curve"],
        "skipped": result.get("data", {}).get("train", {}).get("skipped_messages"),
        "gaps": result.get("data", {}).get("train", {}).get("gaps"),
        "fault": fault.row(),
        "ranks_during_fault": steps_around(workdir / "clock", fault),
    }
    return row | ({"stderr": result["stderr"]} if rc != 0 else {})


def steps_around(clock_dir: Path, fault: FaultAtStep) -> dict[str, dict[str, Any]] | None:
    """Per rank, from its step clock: the steps it took after the fault began and before it ended, after it began,
    and its longest wait between two steps while it lasted (a rank still fetching when the fault fires shows there
    how long its reads waited for the cluster)."""
    if fault.fired_at is None or fault.report is None:
        return None
    began, ended = fault.fired_at, fault.fired_at + fault.report.seconds
    ranks = {}
    for clock in sorted(clock_dir.glob("rank-*")):
        times = [float(t) for t in clock.read_text().split()]
        during = [t for t in times if began <= t <= ended]
        waits = [b - a for a, b in zip(times, times[1:]) if b >= began and a <= ended]
        ranks[clock.name] = {
            "steps": len(times),
            "steps_during": len(during),
            "steps_after_began": sum(t >= began for t in times),
            "last_step_after_began_s": round(times[-1] - began, 1) if times else None,
            "longest_wait_during_s": round(max(waits, default=0.0), 2),
        }
    return ranks


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no choices: argparse checks an empty list against them as one value, and refuses it
    parser.add_argument(
        "faults", nargs="*", metavar="FAULT", help=f"{', '.join(ALL_FAULTS)} (default: all but the upgrade)"
    )
    parser.add_argument(
        "--produce", action="store_true", help="the workload is produces one after another, not batch training"
    )
    parser.add_argument(
        "--stream", action="store_true", help="the workload is continuous training on a live producer's stream"
    )
    parser.add_argument("--rate", type=float, default=40.0, help="--stream: records a second the producer appends")
    parser.add_argument(
        "--client",
        choices=("confluent", "kafka-python"),
        default="confluent",
        help="the workload's Kafka client: the ranks' reader and the producer",
    )
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of the workload's kbit config, e.g. reader.fetch_max_bytes=65536 (repeatable)",
    )
    parser.add_argument("--at-step", type=int, default=5)
    parser.add_argument("--cut-off-s", type=float, default=30.0)
    parser.add_argument(
        "--step-s", type=float, default=2.0, help="each step at least this long: training spans the fault"
    )
    args = parser.parse_args()
    for key_value in args.set:
        if "=" not in key_value:
            parser.error(f"--set {key_value!r}: expected KEY=VALUE")
    for name in set(args.faults) - set(ALL_FAULTS):
        parser.error(f"unknown fault {name!r}; one of: {', '.join(ALL_FAULTS)}")
    args.faults = args.faults or [*faults.FAULTS, *disk_faults.DISK_FAULTS]
    if upgrade.UPGRADE in args.faults[:-1]:
        parser.error(f"{upgrade.UPGRADE} must come last: it leaves the bed on the new release")
    return args


def _print_row(row: dict[str, Any], args: argparse.Namespace) -> None:
    """One JSON line: ``row`` with the workload's client, the 1-minute load average and the time."""
    stamp = {
        "client": args.client,
        "load_1min": round(os.getloadavg()[0], 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(row | stamp), flush=True)


def main() -> None:
    args = _arguments()
    running = bed.running_bed_dir()
    state = bed.load_state(running) if running else None
    if state is None:
        raise SystemExit("the test bed is not up: `kbit cluster up` first")
    if upgrade.UPGRADE in args.faults and not state.options.get("kafka_version"):
        raise SystemExit(f"{upgrade.UPGRADE} needs a bed on an older release: `kbit cluster up --kafka-version 4.3.1`")
    brokers = faults.BedBrokers.from_state(state)
    exit_on_sigterm()
    try:
        with tempfile.TemporaryDirectory(prefix="kbit-faults-") as tmp:
            measure(state, brokers, Path(tmp), args)
    finally:
        healed = end_measuring(brokers)
        if healed:
            print(f"removed a cut-off left in place on {', '.join(healed)}", file=sys.stderr)


def measure(state: bed.BedState, brokers: faults.BedBrokers, tmp: Path, args: argparse.Namespace) -> None:
    """The undisturbed run, then a run per fault of ``args.faults``; a JSON line for each."""
    topic = f"kbit-bed-faults-{tmp.name[-8:]}"
    if args.stream:
        clean = run_stream(
            state,
            tmp / "clean",
            args.records,
            rate=args.rate,
            step_s=args.step_s,
            client=args.client,
            sets=user_sets(args),
        )
        _print_row({"run": "undisturbed", "workload": "stream", **clean}, args)
    elif args.produce:
        clean = _produce_once(state, tmp / "clean", f"{topic}-clean", args)
        _print_row({"run": "undisturbed", "workload": "produce", **clean}, args)
    else:
        train(state, tmp / "produce", topic, args, 0, "produce")  # off the clock
        clean, clean_s, clean_wait, rc = train(state, tmp / "clean", topic, args, args.step_s)
        _print_row(
            {"run": "undisturbed", "rc": rc, "seconds": round(clean_s, 1), "stall_s": round(clean_wait, 2)}, args
        )
    for i, name in enumerate(args.faults):  # a fault named twice runs twice
        workdir = tmp / f"{name}-{i}"
        workdir.mkdir()
        if args.stream:
            row = stream_row(state, brokers, name, workdir, args, clean)
        elif args.produce:
            row = produce_row(state, brokers, name, workdir, args, f"{topic}-clean")
        else:
            row = train_row(state, brokers, name, workdir, args, topic, clean, clean_s)
            row["undisturbed_stall_s"] = round(clean_wait, 2)
        _print_row(row, args)


if __name__ == "__main__":
    main()

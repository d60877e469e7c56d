"""The fault table of docs/reliability.md: batch DDP training on the running test bed (train-cluster: one rank per
node host, TLS + SCRAM to the three brokers, RF 3, min.insync.replicas=2) once undisturbed and once per operator's
fault (kbit_core.testbed.faults, disk_faults), fired from the driver host when rank 0 reaches a step; with
``--produce``, a produce once undisturbed and once with a broker's disk filled halfway (fill-disk; the bed up with
``--log-disk-mb``).

Each row: the job's outcome, its extra wall time, the longest wait between two steps of any rank (the stall) against
the undisturbed run's, and whether the weights and the loss curve equal the undisturbed run's (``torch.equal``: no
record lost, none trained twice, in the same order). Run as root with the bed up (`kbit cluster up`):
``python -m tests.testbed.measure_faults [FAULT ...] [--records N] [--at-step K] [--cut-off-s S] [--step-s T]``
(each step at least T seconds: the run spans the fault; 25 steps of the 2,000 records take ~2 s unstretched), or
``python -m tests.testbed.measure_faults --produce [--records N]``; prints one JSON object per run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kbit_core import testbed as bed
from kbit_core.kafka import contents
from kbit_core.testbed import disk_faults, faults
from kbit_core.train import checkpoint as ckpt
from tests.conftest import FAULT_MODELS_DIR, REPO
from tests.faults.test_fault_replicated import _read_indices
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, bed_sets, run_kbit
from tests.testbed.test_disk_faults import produce_filling_a_disk
from tests.testbed.test_secured_kafka import bed_config

ALL_FAULTS = (*faults.FAULTS, *disk_faults.DISK_FAULTS)


def _fire(name: str, brokers: faults.BedBrokers, topic: str, cut_off_s: float) -> faults.FaultReport:
    if name == "rolling-restart":
        return faults.rolling_restart(brokers)
    if name == "kill-controller":
        return faults.kill_controller(brokers)
    if name == "fill-disk":  # the disk of the leader of rank 0's first partition, until Kafka shut the broker down
        return disk_faults.fill_disk(brokers, [brokers.leader_of(topic, 0)[0]])
    victim, host = brokers.leader_of(topic, 0)  # the leader of rank 0's first partition
    return faults.cut_off(brokers, victim, host, cut_off_s)


def _fire_at_step(clock: Path, step: int, *fault: Any) -> tuple[threading.Thread, list[faults.FaultReport]]:
    """A thread that fires ``_fire(*fault)`` once ``clock`` counts ``step`` steps; the list gets its report."""
    fired: list[faults.FaultReport] = []

    def wait_then_fire() -> None:
        while not clock.exists() or len(clock.read_text().splitlines()) < step:
            time.sleep(0.1)
        fired.append(_fire(*fault))

    thread = threading.Thread(target=wait_then_fire, daemon=True)
    thread.start()
    return thread, fired


def _longest_step_wait(clock_dir: Path) -> float:
    waits = [0.0]
    for clock in clock_dir.glob("rank-*"):
        times = [float(t) for t in clock.read_text().split()]
        waits += [b - a for a, b in zip(times, times[1:])]
    return max(waits)


def train(
    state: bed.BedState, workdir: Path, topic: str, records: int, step_s: float, command: str = "train"
) -> tuple[dict[str, Any], float, float, int]:
    """One train-cluster run on ``topic`` (or with ``command`` produce, its topic only): its result (the error's tail
    when it failed), wall seconds, longest step wait, rc."""
    clock_dir = workdir / "clock"
    clock_dir.mkdir(parents=True)
    model = {"name": "fault_models:step_clock", "kwargs": {"clock_dir": str(clock_dir), "step_s": step_s}}
    extra = {
        "dataset.num_records": records,
        "train.epochs": 1,
        "tracking.enabled": False,
        "train.model": model,
        "launch.spark_conf": {"spark.executorEnv.PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
    }
    sets = [*bed_sets(state, workdir, **extra), "--set", f"produce.topic={topic}"]
    started = time.monotonic()
    done = run_kbit(
        command, "--config", str(TRAIN_CLUSTER), "--json", *sets, env={"PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"}
    )
    result = json.loads(done.stdout) if done.returncode == 0 else {"stderr": done.stderr[-2000:]}
    return result, time.monotonic() - started, _longest_step_wait(clock_dir), done.returncode


def _same_weights(a: dict, b: dict) -> bool:
    ours, theirs = (ckpt.read_file(Path(r["checkpoint"]))[ckpt.MODEL] for r in (a, b))
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def measure_produce(state: bed.BedState, brokers: faults.BedBrokers, records: int) -> None:
    """A produce of ``records`` in 3 partitions undisturbed, then one with the disk of partition 0's leader filled at
    half of them (tests/testbed/test_disk_faults.py); a row each: wall time, longest wait between two sends, records
    lost / twice (every sample index read back), the manifest against the broker's offsets."""
    clean_s = None
    with tempfile.TemporaryDirectory(prefix="kbit-faults-") as tmp:
        for run, fill_at in (("undisturbed", None), ("fill-disk", records // 2)):
            topic = f"kbit-bed-produce-{Path(tmp).name[-8:]}-{run}"
            sets = (f"dataset.num_records={records}", "produce.partitions=3", f"produce.topic={topic}")
            Path(tmp, run).mkdir()
            cfg = bed_config(state, Path(tmp, run), *sets)
            manifest, seconds, wait, report = produce_filling_a_disk(cfg, brokers, fill_at)
            indices = _read_indices(cfg, manifest)
            clean_s = seconds if clean_s is None else clean_s
            row = {
                "run": f"produce, {run}",
                "seconds": round(seconds, 1),
                "extra_s": round(seconds - clean_s, 1),
                "longest_send_wait_s": round(wait, 2),
                "lost": len(set(range(records)) - set(indices)),
                "twice": len(indices) - len(set(indices)),
                "manifest_exact": contents.check_topic(cfg.kafka, manifest).holds_manifest,
                "fault": report.to_dict() if report.steps else None,
                "load_1min": round(os.getloadavg()[0], 1),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            }
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no choices: argparse checks an empty list against them as one value, and refuses it
    parser.add_argument("faults", nargs="*", metavar="FAULT", help=f"{', '.join(ALL_FAULTS)} (default: all)")
    parser.add_argument(
        "--produce", action="store_true", help="the workload is a produce (fill-disk only), not batch training"
    )
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--at-step", type=int, default=5)
    parser.add_argument("--cut-off-s", type=float, default=30.0)
    parser.add_argument(
        "--step-s", type=float, default=2.0, help="each step at least this long: training spans the fault"
    )
    args = parser.parse_args()
    for name in set(args.faults) - set(ALL_FAULTS):
        parser.error(f"unknown fault {name!r}; one of: {', '.join(ALL_FAULTS)}")
    running = bed.running_bed_dir()
    state = bed.load_state(running) if running else None
    if state is None:
        raise SystemExit("the test bed is not up: `kbit cluster up` first")
    brokers = faults.BedBrokers.from_state(state)
    if args.produce:
        measure_produce(state, brokers, args.records)
        return
    with tempfile.TemporaryDirectory(prefix="kbit-faults-") as tmp:
        topic = f"kbit-bed-faults-{Path(tmp).name[-8:]}"
        train(state, Path(tmp, "produce"), topic, args.records, 0, "produce")  # off the clock
        clean, clean_s, clean_wait, rc = train(state, Path(tmp, "clean"), topic, args.records, args.step_s)
        print(
            json.dumps({"run": "undisturbed", "rc": rc, "seconds": round(clean_s, 1), "stall_s": round(clean_wait, 2)})
        )
        for i, name in enumerate(args.faults or ALL_FAULTS):
            workdir = Path(tmp, f"{name}-{i}")
            clock = workdir / "clock" / "rank-0"
            thread, fired = _fire_at_step(clock, args.at_step, name, brokers, topic, args.cut_off_s)
            result, seconds, wait, rc = train(state, workdir, topic, args.records, args.step_s)
            thread.join()
            row = {
                "run": name,
                "rc": rc,
                "seconds": round(seconds, 1),
                "extra_s": round(seconds - clean_s, 1),
                "stall_s": round(wait, 2),
                "undisturbed_stall_s": round(clean_wait, 2),
                "same_weights": rc == 0 and _same_weights(result, clean),
                "same_loss_curve": rc == 0 and result["loss_curve"] == clean["loss_curve"],
                "skipped": result.get("data", {}).get("train", {}).get("skipped_messages"),
                "gaps": result.get("data", {}).get("train", {}).get("gaps"),
                "fault": fired[0].to_dict() if fired else None,
                "load_1min": round(os.getloadavg()[0], 1),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            }
            if rc != 0:
                row["stderr"] = result["stderr"]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

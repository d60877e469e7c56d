"""Where one rank's loader spends its CPU (issue 32): shuffled loader passes over a manifest's topic in a fresh process
per arm, each arm a list of ``--set`` overrides, the arms alternated round by round so that load drifting over the run
hits each alike. Per pass set: samples/s (wall), the process's CPU a record (user and system), its minor page faults
a record, the broker JVM's CPU a record when its PID is given, and the 1-minute load. Prints and writes JSON lines.

``--handoff uint8`` times the batches a CUDA rank's loader hands over (uint8 pixels, which ``batching.to_device``
converts on its GPU): without CUDA here, the loader's CPU conversion to float32 is skipped, as it is on such a rank.

Usage: python scripts/loader_cpu.py MANIFEST.json [--batch N] [--passes P] [--rounds R] [--broker-pid PID]
    [--arm KEY=VALUE[,KEY=VALUE...]]... [--handoff float32|uint8] [--bootstrap HOST:PORT] [--out FILE]
e.g. ``--arm reader.keep_freed_memory=true --arm reader.keep_freed_memory=false``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kbit_core.config.kbit import load_config
from kbit_core.data import loader as shard_loader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.kafka.manifest import Manifest

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _broker_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS


def measure(
    manifest: Path, bootstrap: str, batch: int, passes: int, sets: list[str], broker_pid: int | None, handoff: str
) -> dict:
    """One arm in this process: an untimed pass, then ``passes`` timed ones."""
    if handoff == "uint8":
        shard_loader.model_inputs = lambda batches: batches  # a CUDA rank's loader converts nothing
    cfg = load_config(None, [f"kafka.bootstrap_servers={bootstrap}", f"train.global_batch_size={batch}", *sets])
    with make_split_loader(cfg, Manifest.load(manifest), "train", 0, 1) as loader:
        sum(len(y) for _, y in loader)
        faults, cpu, broker, wall = (
            int(_stat_fields("self")[7]),
            os.times(),
            _broker_cpu_s(broker_pid),
            time.perf_counter(),
        )
        records = sum(len(y) for _ in range(passes) for _, y in loader)
        wall = time.perf_counter() - wall
        after, faults = os.times(), int(_stat_fields("self")[7]) - faults
    per_record = 1e6 / records
    return {
        "sets": sets,
        "handoff": handoff,
        "samples_per_s": round(records / wall),
        "user_us_per_record": round((after.user - cpu.user) * per_record, 3),
        "sys_us_per_record": round((after.system - cpu.system) * per_record, 3),
        "minor_faults_per_record": round(faults / records, 4),
        "broker_cpu_us_per_record": round((_broker_cpu_s(broker_pid) - broker) * per_record, 3) if broker_pid else None,
        "load_1min": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker-pid", type=int)
    parser.add_argument("--arm", action="append", default=[], help="comma-separated --set overrides of one arm")
    parser.add_argument("--handoff", choices=("float32", "uint8"), default="float32")
    parser.add_argument("--bootstrap", default="127.0.0.1:19092")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one-arm", help=argparse.SUPPRESS)  # the child's own run
    args = parser.parse_args()
    if args.one_arm is not None:
        sets = [s for s in args.one_arm.split(",") if s]
        row = measure(args.manifest, args.bootstrap, args.batch, args.passes, sets, args.broker_pid, args.handoff)
        print(json.dumps(row))
        return
    for round_ in range(args.rounds):
        for arm in args.arm or [""]:
            row: dict[str, Any] = {"round": round_, "batch": args.batch, "manifest": args.manifest.name}
            row.update(json.loads(_child(args, arm)))
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(json.dumps(row) + "\n")


def _child(args: argparse.Namespace, arm: str) -> str:
    """The arm's measurement in a fresh process: settings such as the allocator's are a process's for good."""
    command = [sys.executable, __file__, str(args.manifest), "--one-arm", arm, "--batch", str(args.batch)]
    command += ["--passes", str(args.passes), "--bootstrap", args.bootstrap, "--handoff", args.handoff]
    command += ["--broker-pid", str(args.broker_pid)] if args.broker_pid else []
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    main()

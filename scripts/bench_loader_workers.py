"""The loader per ``reader.workers`` (thread, process, partitions) on a private Apache Kafka broker (its data removed
afterwards): `kbit bench-data` (loader ÷ fetch and ÷ read+decode at the default batch and at 512, with spreads over
the rounds) and `kbit bench-train --fast-consumer 0` (streamed ÷ in-memory samples/s, one rank at batch 512) for raw
bytes and Avro lists. Writes JSON, markdown, each step's log and the load average before and after each step to OUT
(default .kbit/loader-workers-bench). With the defaults (50,000 records) it takes under five minutes on 2 idle cores
(4.6 minutes at load average 4-6); docs/data_plane_benchmark.md's figures used
``--records 100000 --repeats 5 --train-repeats 3`` (19 minutes on 2 shared cores).

    PYTHONPATH=. .venv/bin/python scripts/bench_loader_workers.py [--out DIR] [--records N] [--repeats R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kbit_core.brokers.local import embedded_broker
from kbit_core.config import KbitConfig

VARIANTS = ("raw_bytes_none", "avro_list_lz4")
WORKERS = ("thread", "process", "partitions")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kbit(args: list[str], sets: list[str], out: Path, step: str, loads: dict[str, list[float]]) -> None:
    """Run ``kbit ARGS`` with ``--set`` of every entry of ``sets``, its output to OUT/STEP.log."""
    command = [sys.executable, "-m", "kbit_core", *args, *(a for s in sets for a in ("--set", s))]
    loads[f"{step} start"] = list(os.getloadavg())
    t0 = time.monotonic()
    with (out / f"{step}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    loads[f"{step} end"] = list(os.getloadavg())
    print(f"{step}: {time.monotonic() - t0:.0f} s, load average {loads[f'{step} end'][0]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".kbit/loader-workers-bench"))
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3, help="bench-data rounds")
    parser.add_argument("--train-repeats", type=int, default=1, help="bench-train --fast-consumer rounds")
    parser.add_argument("--skip-train", action="store_true", help="only bench-data")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kbit-loader-bench-"))
    port, controller = free_port(), free_port()
    sets = [f"workdir={workdir}", f"kafka.embedded.port={port}", f"kafka.embedded.controller_port={controller}"]
    cfg = KbitConfig.from_dict(
        {"workdir": str(workdir), "kafka": {"embedded": {"port": port, "controller_port": controller}}}
    )
    loads: dict[str, list[float]] = {}
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)  # the broker's data, after it stopped
        cleanup.enter_context(embedded_broker(cfg))
        data = ["bench-data", "-n", str(args.records), "-r", str(args.repeats), "--clients", "confluent", "--no-rss"]
        data += [a for v in VARIANTS for a in ("-v", v)] + [a for w in WORKERS[1:] for a in ("--loader-workers", w)]
        kbit(
            [*data, "--out", str(out / "bench_data.json"), "--markdown", str(out / "bench_data.md")],
            sets,
            out,
            "bench-data",
            loads,
        )
        if not args.skip_train:
            train = ["bench-train", "-c", "deployments/train-smoke.yaml", "--fast-consumer", "0", "-v", VARIANTS[1]]
            train += ["--repeats", str(args.train_repeats)]
            train_sets = [
                *sets,
                "launch.engine=torchrun",
                "launch.num_processes=1",
                "train.global_batch_size=512",
                "produce.variant.format=raw",
                "produce.variant.compression=none",
                f"dataset.num_records={args.records}",
                "tracking.enabled=false",
            ]
            for workers in ("thread", "partitions"):
                step = f"fast-consumer-{workers}"
                kbit(
                    [*train, "--output", str(out / f"{step}.json")],
                    [*train_sets, f"reader.workers={workers}"],
                    out,
                    step,
                    loads,
                )
    (out / "load_average.json").write_text(json.dumps(loads, indent=2))
    print(f"results in {out}")


if __name__ == "__main__":
    main()

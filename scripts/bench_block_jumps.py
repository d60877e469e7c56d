"""What a shuffled block jump costs one confluent reader at each ``fetch.queue.backoff.ms`` (issue 32): one consumer
assigned block after block of a manifest's topic in a shuffled order, as a rank's loader jumps, timing how long
each block takes to arrive; and the CPU the consumer burns while its prefetch queue stays full behind a slower rank.
Arms alternate round by round so that load drifting over the run hits each alike. Prints and writes JSON.

Usage: python scripts/bench_block_jumps.py MANIFEST.json [--block-messages N] [--rounds R] [--arms 10,1]
    [--bootstrap HOST:PORT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from kbit_core.config.data import ReaderConfig
from kbit_core.config.kafka import KafkaConfig
from kbit_core.kafka import consumers
from kbit_core.kafka.manifest import Manifest

FETCH_BYTES = 1 << 20  # what a loader's reader fetches at 4,096 digits a block (a quarter of its bytes, >= 1 MiB)


def _consumer(kafka: KafkaConfig, backoff_ms: int) -> consumers.ConfluentConsumer:
    consumers.QUEUE_FULL_BACKOFF_MS = backoff_ms  # read when the consumer is built
    return consumers.ConfluentConsumer(kafka, ReaderConfig(fetch_max_bytes=FETCH_BYTES))


def one_pass(kafka: KafkaConfig, manifest: Manifest, block: int, backoff_ms: int, seed: int) -> dict[str, float]:
    """Every block of the topic once, in a shuffled order: the pass's seconds and the median block's milliseconds."""
    blocks = [
        (p.partition, start, min(block, p.last_offset + 1 - start))
        for p in manifest.partitions
        for start in range(p.first_offset, p.last_offset + 1, block)
    ]
    random.Random(seed).shuffle(blocks)
    reader, took = _consumer(kafka, backoff_ms), []
    with reader:
        began = time.perf_counter()
        for partition, start, size in blocks:
            t0, got = time.perf_counter(), 0
            reader.assign(manifest.topic, {partition: start})
            while got < size:
                got += len(reader.poll(size - got, 1.0))
            took.append(time.perf_counter() - t0)
        return {"pass_s": time.perf_counter() - began, "block_ms": statistics.median(took) * 1e3}


def cpu_while_full(kafka: KafkaConfig, manifest: Manifest, backoff_ms: int, seconds: float = 5.0) -> float:
    """Percent of a core this process spends while its consumer's queue is full and nobody polls it."""
    with _consumer(kafka, backoff_ms) as reader:
        reader.assign(manifest.topic, {manifest.partitions[0].partition: manifest.partitions[0].first_offset})
        reader.poll(1, 5.0)
        time.sleep(1.0)  # the queue fills
        t0 = os.times()
        time.sleep(seconds)
        t1 = os.times()
    return (t1.user + t1.system - t0.user - t0.system) / seconds * 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--block-messages", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--arms", default="10,1", help="fetch.queue.backoff.ms values, alternated")
    parser.add_argument("--bootstrap", default="127.0.0.1:19092")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kafka = KafkaConfig(bootstrap_servers=args.bootstrap)
    manifest = Manifest.load(args.manifest)
    arms = [int(a) for a in args.arms.split(",")]
    runs: dict[int, list[dict[str, float]]] = {a: [] for a in arms}
    for seed in range(args.rounds):
        for arm in arms:
            runs[arm].append(one_pass(kafka, manifest, args.block_messages, arm, seed))
    doc = {
        "topic": manifest.topic,
        "block_messages": args.block_messages,
        "rounds": args.rounds,
        "load_1min": round(os.getloadavg()[0], 1),
        "arms": {
            str(arm): {
                "pass_s_median": round(statistics.median(r["pass_s"] for r in rows), 4),
                "block_ms_median": round(statistics.median(r["block_ms"] for r in rows), 2),
                "block_ms_per_round": [round(r["block_ms"], 2) for r in rows],
                "cpu_pct_while_queue_full": round(cpu_while_full(kafka, manifest, arm), 2),
            }
            for arm, rows in runs.items()
        },
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Streaming memory: peak RSS of fresh processes that stream a small and a large topic; it should not grow with the
topic."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from kbit_core.bench.dataplane.bench_topics import bench_config, drop_topic, produce_or_reuse
from kbit_core.config import DataVariant, KbitConfig
from kbit_core.errors import KbitError
from kbit_core.kafka.manifest import manifest_path

TARGET_RSS_GROWTH_MB = 100.0
DEFAULT_RSS_RECORDS = (60_000, 600_000)
RSS_VARIANT = DataVariant(format="raw", layout="bytes", compression="none")

# Current RSS sampled after every batch (psutil): ru_maxrss would not do, Linux carries it across exec from
# the (much larger) benchmark process that spawns the probe. With reader.workers process or partitions the loader's
# worker processes count too (listed again every 100 batches, as they start when first needed); shared memory they
# hand over counts in both, so the sum overstates.
RSS_PROBE = """
import contextlib, json, sys, time, psutil
from kbit_core.config import KbitConfig
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.kafka.manifest import Manifest
proc = psutil.Process()
def rss(procs):
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total
cfg = KbitConfig.from_dict(json.load(sys.stdin))
loader = make_split_loader(cfg, Manifest.load(sys.argv[1]), "train", 0, 1)
batches = iter(loader)
next(batches)
procs = [proc, *proc.children(recursive=True)]
base = peak = rss(procs)
records, t0 = loader.batch_size, time.perf_counter()
for i, (_, y) in enumerate(batches):
    records += len(y)
    if i % 100 == 99:
        procs = [proc, *proc.children(recursive=True)]
    peak = max(peak, rss(procs))
seconds = time.perf_counter() - t0
loader.close()
print(json.dumps({"records_read": records, "seconds": seconds, "rss_after_first_batch_mb": base / 2**20,
                  "peak_rss_mb": peak / 2**20}))
"""


def measure_stream_rss(
    cfg: KbitConfig,
    sizes: Sequence[int] = DEFAULT_RSS_RECORDS,
    keep_topics: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Peak RSS of a fresh process (with its loader worker processes) streaming a whole topic of each size (stream
    mode, one rank, ``reader.workers`` of ``cfg``)."""
    runs = []
    for size in sizes:
        size_cfg = bench_config(cfg, size, mode="stream")
        manifest, created = produce_or_reuse(size_cfg, RSS_VARIANT, progress)
        try:
            # the config (with any secret) goes through stdin, never through a file or the command line
            out = subprocess.run(
                [sys.executable, "-c", RSS_PROBE, str(manifest_path(size_cfg.workdir, manifest.topic))],
                input=json.dumps(size_cfg.to_secret_dict()),
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                raise KbitError(f"RSS probe for {size} records failed:\n{out.stderr[-2000:]}")
            runs.append(
                {"records": size, "variant": RSS_VARIANT.name, **json.loads(out.stdout.strip().splitlines()[-1])}
            )
        finally:
            if created and not keep_topics:
                drop_topic(size_cfg, manifest)
    growth = runs[-1]["peak_rss_mb"] - runs[0]["peak_rss_mb"]
    return {
        "runs": runs,
        "peak_growth_mb": growth,
        "target_mb": TARGET_RSS_GROWTH_MB,
        "meets_target": growth <= TARGET_RSS_GROWTH_MB,
    }

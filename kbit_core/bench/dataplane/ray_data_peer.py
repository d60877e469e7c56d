"""Ray Data's own bounded Kafka reader (``ray.data.read_kafka``) timed on kbit's topic, next to kbit's reader.

Ray reads exactly the manifest's offsets (per-partition ``start_offset``/``end_offset``) and decodes with
``map_batches`` through the same codec kbit's reader uses (the fast decoder), into the same arrays (indices,
labels, pixels); the records/s count every record that reached the driver through ``iter_batches``. Two Ray
settings: as shipped (Ray picks the block count) and tuned (``override_num_blocks`` = partitions). What
read_kafka supports and lacks is in docs/data_plane_benchmark.md.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np
from rich.table import Table

from kbit_core.bench.dataplane.peer_table import peer_table as reader_table
from kbit_core.bench.dataplane.peer_table import ratios_text
from kbit_core.config import KbitConfig
from kbit_core.formats.fast import select_codec
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.launch.ray_train import ensure_ray


def measure_read_kafka(cfg: KbitConfig, manifest: Manifest, repeats: int = 3) -> list[dict[str, Any]]:
    """One row per Ray setting: median records/s over ``repeats`` reads after one untimed warm-up, the records
    Ray returned and those it left out (Ray caps each end offset at the broker's reported high watermark)."""
    started = time.perf_counter()
    ensure_ray(cfg)  # first: Ray reads its environment at import
    init_s = time.perf_counter() - started
    # the `ray` extra: optional, and seconds to import
    import ray.data

    settings = {"ray_read_kafka": None, "ray_read_kafka_tuned": len(manifest.partitions)}
    rows = []
    for name, blocks in settings.items():
        seconds, records = [], 0
        for attempt in range(repeats + 1):
            t0 = time.perf_counter()
            records = _read(ray.data, cfg, manifest, blocks)
            if attempt:  # the first read warms Ray's workers and their imports
                seconds.append(time.perf_counter() - t0)
        median_s = statistics.median(seconds)
        rows.append(
            {
                "reader": name,
                "override_num_blocks": blocks,
                "records": records,
                "records_missing": manifest.num_records - records,
                "records_per_s": records / median_s if median_s > 0 else float("nan"),
                "seconds": seconds,
                "ray_init_s": init_s,
            }
        )
    return rows


def _read(data: Any, cfg: KbitConfig, manifest: Manifest, blocks: int | None) -> int:
    ranges = manifest.ranges()
    dataset = data.read_kafka(
        manifest.topic,
        bootstrap_servers=cfg.kafka.resolved_bootstrap(),
        start_offset={manifest.topic: {p: start for p, (start, _) in ranges.items()}},
        end_offset={manifest.topic: {p: stop for p, (_, stop) in ranges.items()}},
        override_num_blocks=blocks,
    ).map_batches(_decode, fn_args=(manifest.model_dump_json(),), batch_format="numpy", batch_size=None)
    return sum(len(batch["label"]) for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"))


def _decode(batch: dict[str, np.ndarray], manifest_json: str) -> dict[str, np.ndarray]:
    """Kafka values -> kbit's arrays, with the manifest's fast decoder (built once per Ray worker process, which
    Ray keeps between reads, so the timed reads find it warm as kbit's reader finds its codec)."""
    decoded = fast_codec(manifest_json).decode(list(batch["value"]))
    return {"index": decoded.indices, "label": decoded.labels, "pixels": decoded.pixels}


@functools.lru_cache(maxsize=8)
def fast_codec(manifest_json: str) -> Any:
    """The manifest's fast decoder, built once per worker process (Ray's and Spark's keep theirs between reads)."""
    return select_codec(manifest_codec(Manifest.model_validate_json(manifest_json), "stock"), "fast")


def compare(cfg: KbitConfig, manifest: Manifest, kbit_rows: list[dict[str, Any]], repeats: int = 3) -> dict[str, Any]:
    """Ray's reader on ``manifest``'s topic next to kbit's rows for it (``bench-data`` rows, one per client, measured
    in the same run): records/s of each, kbit's read+decode rate over Ray's (above 1: kbit is faster), and that target."""
    ray_rows = measure_read_kafka(cfg, manifest, repeats)
    kbit = {row["client"]: row["decode_records_per_s"] for row in kbit_rows}
    ratios = {
        client: {row["reader"]: rate / row["records_per_s"] for row in ray_rows if row["records_per_s"]}
        for client, rate in kbit.items()
    }
    return {
        "variant": manifest.variant.name,
        "topic": manifest.topic,
        "records": manifest.num_records,
        "kbit_records_per_s": kbit,
        "ray": ray_rows,
        "kbit_over_ray": ratios,
        "targets": [
            {
                "target": f"{manifest.variant.name} ({client}) read+decode faster than {reader}",
                "value": round(r, 2),
                "met": r > 1.0,
            }
            for client, by_reader in ratios.items()
            for reader, r in by_reader.items()
        ],
    }


def peer_table(comparisons: list[dict[str, Any]]) -> Table:
    """kbit's read+decode records/s per client next to read_kafka's, as shipped and tuned, with the ratios."""
    return reader_table(
        "kbit's reader vs ray.data.read_kafka (records/s, same topic, same run)",
        comparisons,
        lambda c: (
            (
                row["reader"],
                row["records_per_s"],
                ratios_text(by[row["reader"]] for by in c["kbit_over_ray"].values()),
                row["records_missing"],
            )
            for row in c["ray"]
        ),
    )

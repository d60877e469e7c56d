"""`kbit bench-data` on a topic kbit did not write (``source.topic``): its snapshot's fetch, decode and loader rates
per client, measured as a produced variant's are, with nothing produced or dropped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kbit_core.bench.dataplane.data_plane import evaluate_targets, measure_variant, run_meta
from kbit_core.config import ClientName, KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.topic_dataset import snapshot_dataset


def run_user_topic_bench(
    cfg: KbitConfig,
    clients: Sequence[ClientName] | None = None,
    repeats: int = 3,
    loader_workers: Sequence[str] = (),
    peers: Sequence[str] = (),
) -> dict[str, Any]:
    """The data-plane results (meta, rows, targets) of ``source.topic``'s snapshot, read whole as one split."""
    if peers:
        raise ConfigError(
            f"bench-data's peers ({', '.join(peers)}) read kbit's own formats; on source.topic "
            f"{cfg.source.topic!r} run it without them"
        )
    whole = cfg.override({"shard.split_rates": [1.0], "shard.split_by": "ratio", "shard.split_times": []})
    manifest = snapshot_dataset(whole)
    rows = [
        measure_variant(whole, manifest, client, repeats, loader_workers) for client in clients or cfg.bench.clients
    ]
    meta = run_meta(whole, repeats)
    meta.update(dataset=manifest.dataset.name, records=manifest.num_records, partitions=len(manifest.partitions))
    return {
        "meta": {**meta, "datasets": [manifest.dataset.name], "topic": manifest.topic},
        "rows": [asdict(r) for r in rows],
        "left_out": [],
        "rss": None,
        "targets": evaluate_targets(rows, None),
    }

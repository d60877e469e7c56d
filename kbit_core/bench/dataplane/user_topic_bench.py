"""`kbit bench-data` on a topic kbit did not write (``source.topic``): its snapshot's fetch, decode and loader rates
per client, measured as a produced variant's are, with nothing produced or dropped; on a topic in the Confluent Avro
framing, Ray Data's and Spark's readers beside them in the same run (see peer_harness.framed_avro)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from kbit_core.bench.dataplane.data_plane import Peer, evaluate_targets, measure_variant, run_meta
from kbit_core.config import ClientName, KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.topic_dataset import snapshot_dataset


def run_user_topic_bench(
    cfg: KbitConfig,
    clients: Sequence[ClientName] | None = None,
    repeats: int = 3,
    loader_workers: Sequence[str] = (),
    peers: Mapping[str, Peer] | None = None,
) -> dict[str, Any]:
    """The data-plane results (meta, rows, targets) of ``source.topic``'s snapshot, read whole as one split, and per
    entry of ``peers`` (Ray's or Spark's reader) its comparison with these rows."""
    peers = dict(peers or {})
    if "kafka_tools" in peers:
        raise ConfigError(
            f"Kafka's performance tools measure kbit's own topics only; on source.topic {cfg.source.topic!r} run "
            "bench-data without --kafka-tools"
        )
    whole = cfg.override({"shard.split_rates": [1.0], "shard.split_by": "ratio", "shard.split_times": []})
    manifest = snapshot_dataset(whole)
    rows = [
        measure_variant(whole, manifest, client, repeats, loader_workers) for client in clients or cfg.bench.clients
    ]
    compared = {name: [peer(whole, manifest, [asdict(r) for r in rows], repeats)] for name, peer in peers.items()}
    meta = run_meta(whole, repeats)
    meta.update(dataset=manifest.dataset.name, records=manifest.num_records, partitions=len(manifest.partitions))
    return {
        "meta": {**meta, "datasets": [manifest.dataset.name], "topic": manifest.topic},
        "rows": [asdict(r) for r in rows],
        "left_out": [],
        "rss": None,
        "targets": evaluate_targets(rows, None) + [t for runs in compared.values() for c in runs for t in c["targets"]],
        **compared,
    }

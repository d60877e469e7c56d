"""ray.data.read_kafka on kbit's topic, next to kbit's reader in the same run (real broker, the session's Ray head)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from kbit_core.bench.dataplane.data_plane import measure_variant
from kbit_core.bench.dataplane.ray_data_peer import compare
from kbit_core.produce import produce_dataset

pytestmark = [pytest.mark.kafka, pytest.mark.ray]


def test_read_kafka_reads_the_planned_offsets_and_is_compared_with_kbit(make_ray_config, topic_name):
    cfg = make_ray_config(
        produce={
            "topic": topic_name,
            "partitions": 2,
            "variant": {"format": "raw", "layout": "bytes", "compression": "lz4"},
        },
        dataset={"num_records": 3000},
        shard={"split_rates": [1.0]},
    )
    manifest = produce_dataset(cfg, progress=False)
    kbit = asdict(measure_variant(cfg, manifest, "confluent", repeats=1))

    result = compare(cfg, manifest, [kbit], repeats=1)

    assert result["kbit_records_per_s"] == {"confluent": kbit["decode_records_per_s"]}
    assert [row["reader"] for row in result["ray"]] == ["ray_read_kafka", "ray_read_kafka_tuned"]
    for row in result["ray"]:
        # Ray never reads past the planned end; what it leaves out is counted, not lost silently
        assert 0 < row["records"] <= manifest.num_records
        assert row["records"] + row["records_missing"] == manifest.num_records
        assert row["records_per_s"] > 0 and len(row["seconds"]) == 1
    assert result["ray"][1]["override_num_blocks"] == 2
    ratios = result["kbit_over_ray"]["confluent"]
    assert set(ratios) == {"ray_read_kafka", "ray_read_kafka_tuned"} and all(r > 0 for r in ratios.values())

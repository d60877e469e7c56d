"""Ray Data's read_kafka (confluent-kafka's AvroDeserializer) and Spark's Kafka source (from_avro past the 5-byte
header) on a user's topic in the Confluent Avro framing, beside kbit's reader on the same snapshot in the same run
(real broker, the session's Schema Registry and Ray head, Spark in a process of its own)."""

from __future__ import annotations

from typing import Any

import pytest

from kbit_core.bench.dataplane import ray_data_peer, spark_kafka_peer
from kbit_core.bench.dataplane.user_topic_bench import run_user_topic_bench
from kbit_core.service import Service
from tests.integration.test_user_registry_topics import RECORDS, garment_config, write_garments
from tests.integration.user_topics import end_offsets

pytestmark = [pytest.mark.kafka, pytest.mark.ray, pytest.mark.slow]


def test_ray_and_spark_read_a_registry_framed_topic_beside_kbit(
    broker: Any, schema_registry: Service, make_ray_config: Any, topic_name: str
) -> None:
    write_garments(broker, schema_registry, topic_name)
    cfg = garment_config(make_ray_config, schema_registry, topic_name).override({"bench.clients": ["confluent"]})
    peers = {"ray_read_kafka": ray_data_peer.compare, "spark_kafka_source": spark_kafka_peer.compare}
    results = run_user_topic_bench(cfg, repeats=1, peers=peers)
    [row] = results["rows"]
    assert row["records"] == RECORDS and row["decode_records_per_s"] > 0
    [ray] = results["ray_read_kafka"]
    [spark] = results["spark_kafka_source"]
    for comparison, key, readers in ((ray, "ray", 2), (spark, "spark", 1)):
        assert comparison["topic"] == topic_name and len(comparison[key]) == readers
        for peer_row in comparison[key]:
            # every record decoded by the peer's own Avro reader reached the driver; none was left out
            assert peer_row["records"] == RECORDS and peer_row["records_missing"] == 0, peer_row
            assert peer_row["records_per_s"] > 0
        assert all(ratio > 0 for ratio in comparison[f"kbit_over_{key}"]["confluent"].values())
    peer_targets = [t["target"] for t in results["targets"] if "faster than" in t["target"]]
    assert any("ray_read_kafka" in t for t in peer_targets) and any("spark_kafka_source" in t for t in peer_targets)
    assert end_offsets(broker, topic_name) == {0: (0, RECORDS // 2), 1: (0, RECORDS // 2)}  # nothing written

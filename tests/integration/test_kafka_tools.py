"""The data-plane benchmark's peers on the real broker: Kafka's own performance tools and Spark's Kafka source."""

from __future__ import annotations

import pytest

from kbit_core.bench.dataplane import kafka_tools
from kbit_core.bench.dataplane.spark_kafka_peer import measure_spark_source
from kbit_core.brokers.kafka_release import run_kafka_tool
from kbit_core.errors import KbitError
from kbit_core.kafka import admin, offsets
from tests.integration.dataplane_fixtures import RAW, Produce

pytestmark = pytest.mark.kafka


def test_kafka_tools_run_on_the_topic_and_their_summaries_parse(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 300, partitions=2)
    read = kafka_tools.consumer_performance(cfg, manifest.topic, manifest.num_messages)
    assert read.records_per_s > 0 and read.mb_per_s > 0

    topic = "kbit-perf-test-" + manifest.topic[-8:]
    admin.create_topic(cfg.kafka, topic, 2)
    try:
        sent = kafka_tools.producer_performance(cfg, topic, 500, 100, "lz4")
        assert sent.records_per_s > 0
        assert sent.mb_per_s == pytest.approx(sent.records_per_s * 100 / 1e6)
        assert sum(offsets.exact_end_offsets(cfg.kafka, topic).values()) == 500
    finally:
        admin.delete_topic(cfg.kafka, topic)
    # a tool that cannot do its work is an error with the tool's own words, not a rate of zero
    with pytest.raises(KbitError, match="Kafka's ConsumerPerformance failed"):
        run_kafka_tool("ConsumerPerformance", ["--topic", manifest.topic])
    with pytest.raises(KbitError, match="no ProducerPerformance summary"):
        kafka_tools.parse_producer_performance("1 records sent, 0.1 records/sec", 100)


@pytest.mark.slow
def test_spark_kafka_source_reads_exactly_the_manifest(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 300, partitions=2)
    result = measure_spark_source(cfg, manifest, repeats=1)
    assert result["records"] == 300 and result["records_missing"] == 0
    assert len(result["seconds"]) == 1 and result["records_per_s"] > 0

"""The one consumer factory: what a consumer is for, translated alike for both clients."""

from __future__ import annotations

import confluent_kafka
import pytest

from kbit_core.config import KafkaConfig
from kbit_core.errors import ConfigError
from kbit_core.kafka.clients import ConsumerUse, consumer_options


def test_no_consumer_commits_or_shares_a_group_unless_its_use_names_one() -> None:
    kcfg, use = KafkaConfig(), ConsumerUse(purpose="reader")
    first, second = consumer_options(kcfg, use, "confluent"), consumer_options(kcfg, use, "confluent")
    assert first["enable.auto.commit"] is False and first["enable.auto.offset.store"] is False
    assert first["group.id"].startswith("kbit-reader-") and first["group.id"] != second["group.id"]
    fixed = consumer_options(kcfg, ConsumerUse(purpose="stream", group="kbit-stream-t"), "confluent")
    assert fixed["group.id"] == "kbit-stream-t"
    python = consumer_options(kcfg, use, "kafka-python")
    assert python["group_id"] is None and python["enable_auto_commit"] is False
    assert python["client_id"].startswith("kbit-reader-")


def test_isolation_fetch_sizes_and_offset_reset_mean_the_same_on_both_clients() -> None:
    use = ConsumerUse(
        purpose="reader", read_committed=True, fetch_wait_ms=7, fetch_max_bytes=4096, partition_fetch_bytes=2048
    )
    confluent = consumer_options(KafkaConfig(), use, "confluent")
    python = consumer_options(KafkaConfig(), use, "kafka-python")
    assert (confluent["isolation.level"], python["isolation_level"]) == ("read_committed", "read_committed")
    assert (confluent["fetch.wait.max.ms"], python["fetch_max_wait_ms"]) == (7, 7)
    assert (confluent["fetch.max.bytes"], python["fetch_max_bytes"]) == (4096, 4096)
    assert (confluent["max.partition.fetch.bytes"], python["max_partition_fetch_bytes"]) == (2048, 2048)
    assert (confluent["auto.offset.reset"], python["auto_offset_reset"]) == ("error", "none")
    # unset: each client's own default, not a value kbit chose
    lenient = ConsumerUse(purpose="registry", reset_is_error=False)
    assert "auto.offset.reset" not in consumer_options(KafkaConfig(), lenient, "confluent")
    assert "fetch.wait.max.ms" not in consumer_options(KafkaConfig(), lenient, "confluent")
    assert "isolation_level" not in consumer_options(KafkaConfig(), lenient, "kafka-python")


def test_the_use_s_own_tuning_comes_last_and_an_unknown_client_is_named() -> None:
    use = ConsumerUse(purpose="reader", fetch_wait_ms=1, tuning={"queued.min.messages": 9, "fetch.wait.max.ms": 3})
    opts = consumer_options(KafkaConfig(), use, "confluent")
    assert (opts["queued.min.messages"], opts["fetch.wait.max.ms"]) == (9, 3)
    with pytest.raises(ConfigError, match="unknown Kafka client 'librdkafka'"):
        consumer_options(KafkaConfig(), use, "librdkafka")  # type: ignore[arg-type]


def test_a_confluent_consumer_takes_fetches_smaller_than_librdkafka_s_request_limit() -> None:
    # librdkafka refuses fetch.max.bytes below message.max.bytes (1,000,000 by default): the bound is lowered with
    # the fetch, so a reader (or kafka-python's confluent offset probe) with reader.fetch_max_bytes 64 KiB starts
    small = ConsumerUse(purpose="reader", fetch_max_bytes=65536, partition_fetch_bytes=65536)
    opts = consumer_options(KafkaConfig(), small, "confluent")
    assert opts["message.max.bytes"] == 65536
    confluent_kafka.Consumer(opts).close()
    assert "message.max.bytes" not in consumer_options(KafkaConfig(), ConsumerUse(purpose="reader"), "confluent")
    # one the user set is theirs: above the fetch it is refused in one line naming both settings
    fitting = consumer_options(KafkaConfig(extra={"message.max.bytes": 32768}), small, "confluent")
    assert fitting["message.max.bytes"] == 32768
    confluent_kafka.Consumer(fitting).close()
    with pytest.raises(ConfigError, match=r"fetch.max.bytes=65536 \(reader.fetch_max_bytes\) is below kafka.extra's "):
        consumer_options(KafkaConfig(extra={"message.max.bytes": 2_000_000}), small, "confluent")

"""A user's topic whose labels and features live in message keys, headers and timestamps (written with
confluent-kafka alone), snapshotted and read by both consumer clients on the real broker."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from confluent_kafka import Producer

from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError
from kbit_core.kafka.manifest import manifest_path
from kbit_core.topic_dataset import snapshot_dataset
from tests.integration.user_topics import bootstrap, create_user_topic

pytestmark = pytest.mark.kafka

RECORDS = 60
BASE_MS = 1_700_000_000_000


def _fill(broker, topic: str) -> None:
    """Record i: value {"reading": i}, key "hot"/"cold", header "site" (int32) i % 3, timestamp BASE_MS + i; every
    tenth without a key (i % 10 == 9), another tenth without the header (i % 10 == 4)."""
    producer = Producer({"bootstrap.servers": bootstrap(broker)})
    for i in range(RECORDS):
        key = None if i % 10 == 9 else (b"hot" if i % 2 else b"cold")
        headers = [] if i % 10 == 4 else [("site", (i % 3).to_bytes(4, "big"))]
        producer.produce(
            topic, orjson.dumps({"reading": i}), key, partition=i % 2, headers=headers, timestamp=BASE_MS + i
        )
    assert producer.flush(30) == 0


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_labels_from_keys_and_features_from_headers_and_timestamps(broker, make_config, topic_name, client):
    create_user_topic(broker, topic_name)
    _fill(broker, topic_name)
    mapping = {
        "features": ["reading", "@timestamp", "@header.site"],
        "label": "@key",
        "header_format": "int32",
        "nulls": "skip",
    }
    cfg = make_config(
        {"source": {"topic": topic_name, "mapping": mapping}, "tracking": {"enabled": False}},
        shard__split_rates=[1.0],
        kafka__client=client,
        reader__bad_records="skip",
        train__global_batch_size=4,
    )
    manifest = snapshot_dataset(cfg)
    assert manifest.source.vocabulary == ["cold", "hot"]  # discovered from the keys (the keyless ones left out)
    loader = make_split_loader(cfg, manifest, "train", 0, 1)
    rows = {}
    for batch in loader.iter_indexed():
        for index, features, label in zip(batch.indices, batch.x, batch.y):
            rows[int(index)] = (features.tolist(), int(label))  # a padded batch repeats rows
    # a null label is a bad record (skipped under reader.bad_records: skip), a null feature is skipped (nulls: skip)
    assert loader.reader.stats.skipped == 2 * RECORDS // 10
    # partition 0 holds the even i (indices 0..29), partition 1 the odd i (indices 30..59)
    expected = {}
    for i in range(RECORDS):
        if i % 10 not in (4, 9):
            index = i // 2 + (i % 2) * (RECORDS // 2)
            expected[index] = ([float(i), float(np.float32(BASE_MS + i)), float(i % 3)], i % 2)
    assert rows == expected


def test_a_message_field_that_cannot_fit_is_one_line_before_anything_is_read(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    _fill(broker, topic_name)
    mapping = {"features": ["reading"], "label": "@header.site", "header_format": "bytes"}
    cfg = make_config({"source": {"topic": topic_name, "mapping": mapping}})
    with pytest.raises(ConfigError) as exc:
        snapshot_dataset(cfg)
    assert str(exc.value) == (
        "source.mapping: field '@header.site' is bytes (source.mapping.header_format: bytes), the mapping needs int "
        "or string"
    )
    assert not manifest_path(cfg.workdir, topic_name).exists()

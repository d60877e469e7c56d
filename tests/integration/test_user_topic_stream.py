"""Continuous training on a topic kbit did not write, while the example producer (confluent-kafka's AvroSerializer
against the real Schema Registry) writes it: records indexed by offset, not by their keys; the first records held
out as a snapshot, nothing created beside the topic; bad records named by their coordinates or skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from examples.fashion_mnist_producer import CATEGORIES, SCHEMA, Photo, produce_photos
from kbit_core.brokers.schema_registry import local_registry
from kbit_core.config import KbitConfig, LocalRegistryConfig
from kbit_core.errors import CorruptRecordError, SchemaRegistryError
from kbit_core.jobs.train import train
from kbit_core.jobs.user_stream import heldout_snapshot, user_stream_config
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.service import Service
from kbit_core.stream.ledger import expand_runs
from kbit_core.stream.source import StreamSource
from tests.conftest import Background, free_port, require_schema_registry
from tests.integration.user_topics import USER_MAPPING, bootstrap, create_user_topic, fill_user_topic

pytestmark = pytest.mark.kafka

HELD_OUT = 10  # the first 5 records of each of 2 partitions
# The example producer's photo (example.wardrobe.ProductPhoto) as a 1x28x28 image of one of its categories.
PHOTO_MAPPING = dict(
    features=["photo.grey"], encoding="bytes", shape=[1, 28, 28], dtype="uint8", label="category", vocabulary=CATEGORIES
)


def photos(count: int) -> list[Photo]:
    """Photo n is grey level n everywhere, of class n % 10: a record tells which it is."""
    return [Photo(bytes([n % 256]) * 784, n % 10, "train", 1_700_000_000_000 + n) for n in range(count)]


def stream_cfg(make_config: Any, registry: Service, topic: str, **dotted: Any) -> KbitConfig:
    overrides = {
        "source": {"topic": topic, "value_format": "confluent-avro", "mapping": PHOTO_MAPPING},
        "registry": {"url": registry.url},
        "train": {"mode": "continuous", "global_batch_size": 8},
        "kafka": {"client": "confluent"},
        "stream": {"eval_records": HELD_OUT, "idle_timeout_s": 60, "fill_timeout_s": 0.3},
        "tracking": {"enabled": False},
    }
    return make_config(overrides, **dotted)


def writing(broker: Any, registry: Service, topic: str, count: int, rate: float) -> Background:
    """The example producer writing ``count`` photos at ``rate`` a second, in the background."""
    return Background(produce_photos, bootstrap(broker), registry.url, topic, photos(count), partitions=2, rate=rate)


def trained_indices(trained: dict[int, list[list[int]]]) -> list[int]:
    """Every index the ledger's runs (stride 2: two partitions) hold, repeats kept, in order."""
    return sorted(index for runs in trained.values() for index in expand_runs(runs, 2).tolist())


def read_stream(source: StreamSource, records: int) -> list[tuple[int, int, int]]:
    """(index, grey level, label) of the next ``records`` records the stream hands out."""
    got: list[tuple[int, int, int]] = []
    while len(got) < records:
        ready = source.fill(min(8, records - len(got)), timeout_s=30)
        assert ready, f"the stream stalled after {len(got)} records"
        batch = source.take(ready)
        grey = (batch.x[:, 0, 0, 0].numpy() * 255).round().astype(int)
        got += list(zip(batch.indices.tolist(), grey.tolist(), batch.y.tolist()))
    return got


def test_the_stream_reads_a_registry_framed_topic_by_offset_while_the_example_producer_writes_it(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str
) -> None:
    producer = writing(broker, schema_registry, topic_name, 60, rate=200)
    cfg = user_stream_config(stream_cfg(make_config, schema_registry, topic_name))
    assert cfg.produce.partitions == 2 and cfg.stream.topic == topic_name
    heldout = heldout_snapshot(cfg)
    assert [(p.partition, p.first_offset, p.num_messages) for p in heldout.partitions] == [(0, 0, 5), (1, 0, 5)]
    source = StreamSource(
        cfg, manifest_codec(heldout, "fast", cfg.registry), topic_name, (0, 1), 2, first_offsets={0: 5, 1: 5}
    )
    source.start_fresh()
    got = read_stream(source, 50)
    assert producer.result(60) == 60
    # photo n went to partition n % 2 at offset n // 2: its index, offset * partitions + partition, is n; its key
    # ("train-n") is not read
    assert [index for index, _, _ in got] == list(range(HELD_OUT, 60))
    assert all(grey == index and label == index % 10 for index, grey, label in got)
    assert trained_indices({p: pos.trained for p, pos in source.positions.items()}) == list(range(HELD_OUT, 60))
    source.close()
    topics = AdminClient({"bootstrap.servers": bootstrap(broker)}).list_topics(timeout=10).topics
    assert not [t for t in topics if t.startswith(topic_name) and t != topic_name]  # nothing beside it


def test_bad_records_in_a_users_stream_are_named_by_their_coordinates_or_skipped_and_counted(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str
) -> None:
    assert produce_photos(bootstrap(broker), schema_registry.url, topic_name, photos(20), partitions=2) == 20
    stranger = Producer({"bootstrap.servers": bootstrap(broker)})
    stranger.produce(topic_name, b'{"not": "framed"}', partition=0)  # offset 10
    stranger.produce(topic_name, b"\x00" + (987654).to_bytes(4, "big") + b"\x02", partition=0)  # offset 11
    assert stranger.flush(10) == 0
    assert produce_photos(bootstrap(broker), schema_registry.url, topic_name, photos(4), partitions=2) == 4
    cfg = user_stream_config(stream_cfg(make_config, schema_registry, topic_name))
    heldout = heldout_snapshot(cfg)
    codec = manifest_codec(heldout, "fast", cfg.registry)
    failing = StreamSource(cfg, codec, topic_name, (0,), 2, first_offsets={0: 5})
    failing.start_fresh()
    with pytest.raises(CorruptRecordError) as exc:
        read_stream(failing, 9)
    message = str(exc.value)
    assert "\n" not in message and "not in the Confluent framing" in message
    assert f"topic={topic_name}, partition=0, offset=10" in message
    failing.close()
    skipping = StreamSource(
        cfg.override({"reader.bad_records": "skip"}), codec, topic_name, (0,), 2, first_offsets={0: 5}
    )
    skipping.start_fresh()
    got = read_stream(skipping, 7)  # offsets 5..9, then 12 and 13 (photos 0 and 2 of the second run)
    assert [index for index, _, _ in got] == [10, 12, 14, 16, 18, 24, 26]
    assert [grey for _, grey, _ in got] == [10, 12, 14, 16, 18, 0, 2]
    assert skipping.skipped == 2
    skipping.close()


def test_a_plain_json_users_topic_streams_by_offset_though_its_keys_are_numbers(
    broker: Any, make_config: Any, topic_name: str
) -> None:
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 40)  # keys: large random numbers, which kbit's own stream would take as indices
    mapping = {**USER_MAPPING, "vocabulary": ["cold", "hot"]}
    cfg = make_config(
        {"source": {"topic": topic_name, "mapping": mapping}, "train": {"mode": "continuous"}},
        stream__eval_records=HELD_OUT,
        tracking__enabled=False,
    )
    cfg = user_stream_config(cfg)
    heldout = heldout_snapshot(cfg)
    source = StreamSource(cfg, manifest_codec(heldout, "fast"), topic_name, (0, 1), 2, first_offsets={0: 5, 1: 5})
    source.start_fresh()
    taken = [index for index, _, _ in read_stream(source, 30)]
    assert taken == list(range(HELD_OUT, 40))  # record i went to partition i % 2 at offset i // 2
    source.close()


@pytest.mark.slow
def test_continuous_training_on_a_users_topic_while_the_example_producer_writes_it(
    broker: Any, schema_registry: Service, make_config: Any, topic_name: str
) -> None:
    held_out = 40  # halves of 20 over 2 ranks: each evaluates whole batches of 4
    producer = writing(broker, schema_registry, topic_name, held_out + 320, rate=100)
    cfg = stream_cfg(
        make_config,
        schema_registry,
        topic_name,
        stream__eval_records=held_out,
        launch__engine="torchrun",
        launch__num_processes=2,
        stream__stop_after_records=320,
        stream__eval_every_steps=10,
        stream__report_every_steps=5,
        train__model={"name": "mlp", "kwargs": {"hidden": 16}},
    )
    result = train(cfg, progress=False)
    assert producer.result(60) == held_out + 320
    assert result["topic"] == topic_name and result["heldout_records"] == held_out
    assert result["stop_reason"] == "records" and result["records"] == 320
    assert result["test_accuracy"] is not None and result["skipped_records"] == 0
    # every record after the held-out ones, once
    assert trained_indices(dict(enumerate(result["trained"]))) == list(range(held_out, held_out + 320))
    topics = AdminClient({"bootstrap.servers": bootstrap(broker)}).list_topics(timeout=10).topics
    assert not [t for t in topics if t.startswith(topic_name) and t != topic_name]


def test_a_registry_that_goes_down_under_a_users_stream_is_one_line_and_nothing_is_trained_twice_or_skipped(
    broker: Any, make_config: Any, topic_name: str, tmp_path: Path
) -> None:
    require_schema_registry()
    own = local_registry(
        tmp_path / "registry", LocalRegistryConfig(enabled=True, port=free_port(), management_port=free_port())
    )
    own.start(timeout_s=180.0)  # this test's own registry: the session's is never stopped
    try:
        assert produce_photos(bootstrap(broker), own.url, topic_name, photos(20), partitions=2) == 20
        cfg = stream_cfg(make_config, own, topic_name, registry__deadline_s=2, registry__request_timeout_s=0.5)
        cfg = user_stream_config(cfg.override({"reader.bad_records": "skip"}))  # the registry's fault is no record's
        heldout = heldout_snapshot(cfg)
        source = StreamSource(
            cfg, manifest_codec(heldout, "fast", cfg.registry), topic_name, (0, 1), 2, first_offsets={0: 5, 1: 5}
        )
        source.start_fresh()
        assert [index for index, _, _ in read_stream(source, 10)] == list(range(HELD_OUT, 20))
        # the producer's schema evolves (a field with a default): a new schema id, registered while the registry is up
        evolved = {**SCHEMA, "fields": [*SCHEMA["fields"], {"name": "season", "type": "string", "default": "all"}]}
        serializer = AvroSerializer(SchemaRegistryClient({"url": own.url}), json.dumps(evolved))
        value = {"photo": {"grey": bytes(784), "width": 28, "height": 28}, "category": "Bag", "subset": "train"}
        framed = [serializer({**value, "season": "winter"}, SerializationContext(topic_name, MessageField.VALUE))] * 4
        new_id = int.from_bytes(framed[0][1:5], "big")
    finally:
        own.stop()
    late = Producer({"bootstrap.servers": bootstrap(broker)})
    for n, data in enumerate(framed):
        late.produce(topic_name, data, partition=n % 2)  # offsets 10 and 11 of each partition
    assert late.flush(10) == 0
    with pytest.raises(SchemaRegistryError) as failed:
        read_stream(source, 4)
    message = str(failed.value)
    assert "\n" not in message and f"did not answer for schema id {new_id} (topic {topic_name})" in message
    assert "registry.deadline_s=2s" in message and failed.value.schema_id == new_id
    assert f"(topic={topic_name}, partition=0, offset=10)" in message or (
        f"(topic={topic_name}, partition=1, offset=10)" in message
    )  # the first record that asked for the schema, whichever partition the stream polled first
    # nothing trained twice, nothing skipped: the ledger holds the 10 records before the new schema, once each
    assert trained_indices({p: pos.trained for p, pos in source.positions.items()}) == list(range(HELD_OUT, 20))
    assert source.skipped == 0
    source.close()

"""A split by key hash on a user's topic (keys written by confluent-kafka, never kbit's producer): every record of a
key lands in one split, the same in every run, the splits' sizes follow the rates; null keys and incompatible
settings are refused in one line."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kbit_core.config import KbitConfig
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError
from kbit_core.jobs.preflight import check_training
from kbit_core.key_splits import key_hash_splits
from kbit_core.topic_dataset import snapshot_dataset
from tests.integration.user_topics import USER_MAPPING, bootstrap, create_user_topic, user_record

pytestmark = pytest.mark.kafka

RATES = [0.6, 0.2, 0.2]


def _fill_keyed(broker, topic: str, count: int, keys: int, null_at: int | None = None) -> None:
    """``count`` JSON records keyed by ``keys`` user ids, each key's records spread over both partitions."""
    rng = np.random.default_rng(7)
    producer = Producer({"bootstrap.servers": bootstrap(broker), "linger.ms": 5})
    for i in range(count):
        key = None if i == null_at else f"customer-{rng.integers(0, keys)}".encode()
        producer.produce(topic, orjson.dumps(user_record(rng)), key, partition=i % 2)
    assert producer.flush(30) == 0


def _keys(broker, topic: str, count: int) -> dict[tuple[int, int], bytes]:
    """(partition, offset) -> key, read back with confluent-kafka."""
    consumer = Consumer({"bootstrap.servers": bootstrap(broker), "group.id": "unused", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in (0, 1)])
    out = {}
    try:
        while len(out) < count:
            for m in consumer.consume(500, timeout=5):
                out[m.partition(), m.offset()] = m.key()
    finally:
        consumer.close()
    return out


def _key_hash_config(make_config, topic: str, **dotted) -> KbitConfig:
    return make_config(
        {"source": {"topic": topic, "mapping": USER_MAPPING}, "tracking": {"enabled": False}},
        shard__split_by="key_hash",
        shard__split_rates=RATES,
        train__global_batch_size=10,
        train__model={"name": "mlp"},
        **dotted,
    )


def test_a_split_by_key_hash_keeps_every_key_in_one_split(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    _fill_keyed(broker, topic_name, 1200, keys=150)
    cfg = _key_hash_config(make_config, topic_name)
    check_training(cfg)  # preflight plans the splits from the snapshot's key runs
    manifest = snapshot_dataset(cfg)
    keys = _keys(broker, topic_name, 1200)
    loaders = {split: make_split_loader(cfg, manifest, split, 0, 1) for split in ("train", "val", "test")}
    planned = {
        s: {(r.partition, o) for r in loader.schedule.plan.splits[s] for o in r.offsets()}
        for s, loader in loaders.items()
    }
    assert sum(map(len, planned.values())) == 1200 and set.union(*planned.values()) == set(keys)
    key_sets = {split: {keys[at] for at in offsets} for split, offsets in planned.items()}
    assert not (
        key_sets["train"] & key_sets["val"]
        or key_sets["train"] & key_sets["test"]
        or key_sets["val"] & key_sets["test"]
    )
    for i, split in enumerate(("train", "val", "test")):  # the pure function's split of each key
        assert set(key_hash_splits(sorted(key_sets[split]), RATES).tolist()) == {i}
        assert abs(len(planned[split]) / 1200 - RATES[i]) < 0.1, {s: len(o) for s, o in planned.items()}
    starts = manifest.source.partition_starts(manifest.partitions)
    seen = {int(i) for batch in loaders["val"].iter_indexed() for i in batch.indices}
    assert seen == {starts[p][1] + o - starts[p][0] for p, o in planned["val"]}  # the loader reads the scattered runs
    again = snapshot_dataset(cfg.override({"source.snapshot": "new", "workdir": str(cfg.workdir) + "-again"}))
    assert again.source.key_runs == manifest.source.key_runs  # stable across runs
    redrawn = cfg.override({"shard.split_rates": [0.5, 0.25, 0.25]})  # the snapshot's runs were drawn for RATES
    with pytest.raises(ConfigError, match=r"key_hash needs a snapshot of topic .* taken for shard.split_rates="):
        make_split_loader(redrawn, manifest, "train", 0, 1)


def test_a_record_without_a_key_and_incompatible_settings_are_one_line(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    _fill_keyed(broker, topic_name, 40, keys=10, null_at=25)
    with pytest.raises(ConfigError) as exc:
        snapshot_dataset(_key_hash_config(make_config, topic_name))
    message = str(exc.value)
    assert "\n" not in message and f"topic {topic_name!r} partition 1 offset 12 has no message key" in message
    for dotted, reason in [
        ({"source": {"topic": None, "mapping": None}}, "splits a snapshot of a user's topic (source.topic)"),
        ({"train": {"mode": "continuous"}}, "continuous training (train.mode=continuous) holds out"),
        ({"shard": {"split_times": ["2026-01-01T00:00:00Z"]}}, "split_times is set exactly when"),
    ]:
        with pytest.raises(ConfigError) as exc:
            _key_hash_config(make_config, topic_name).override(dotted)
        [line] = [line for line in str(exc.value).splitlines()[1:]]  # one error, on one line
        assert reason in line

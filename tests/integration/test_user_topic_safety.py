"""No kbit command deletes, recreates or writes to a topic kbit did not create (issue 31): each command tried on a
user's topic made and filled with confluent-kafka, which must hold exactly its records afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.kafka import admin
from tests.integration.user_topics import USER_MAPPING, bootstrap, create_user_topic, end_offsets, fill_user_topic

pytestmark = pytest.mark.kafka

runner = CliRunner()


def _records(broker, topic: str) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every (partition, offset, key, value) of ``topic``."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap(broker), "group.id": "safety-probe", "enable.partition.eof": True}
    )
    ends = end_offsets(broker, topic)
    consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
    found, eof = [], set()
    try:
        while len(eof) < len(ends):
            for msg in consumer.consume(100, 1.0):
                if msg.error() is None:
                    found.append((msg.partition(), msg.offset(), msg.key(), msg.value()))
                else:
                    eof.add(msg.partition())
    finally:
        consumer.close()
    return sorted(found)


@pytest.fixture
def user_topic(broker, topic_name):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 60)
    before = _records(broker, topic_name)
    yield topic_name
    assert _records(broker, topic_name) == before, "a kbit command changed the user's topic"


@pytest.fixture
def profile(make_config, tmp_path: Path) -> Path:
    cfg = make_config(dataset__num_records=200, tracking__enabled=False)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def _kbit(*args: str):
    return runner.invoke(app, list(args))


def _refusal(result, topic: str) -> str:
    assert result.exit_code != 0, result.output
    message = " ".join(result.output.split())
    assert f"topic '{topic}' exists and kbit did not create it" in message, message
    assert "--recreate" not in message and f"source.topic={topic}" in message
    return message


def test_produce_with_recreate_refuses_and_leaves_every_record(user_topic, profile):
    _refusal(_kbit("produce", "--config", str(profile), "--topic", user_topic, "--recreate"), user_topic)
    _refusal(_kbit("produce", "--config", str(profile), "--topic", user_topic), user_topic)


def test_train_and_bench_data_on_it_as_kbits_topic_refuse(user_topic, profile, make_config):
    sets = ["--config", str(profile), "--set", f"produce.topic={user_topic}"]
    _refusal(_kbit("train", *sets), user_topic)
    prefix = user_topic.split(".")[0]
    # bench-data derives its topic names: a user's topic under such a name is refused as well
    cfg = make_config(dataset__num_records=200, produce__topic_prefix=prefix)
    derived = cfg.produce.topic_for(cfg.dataset, cfg.produce.variant)
    create_user_topic_like(cfg, derived)
    result = _kbit(
        "bench-data",
        "--config",
        str(profile),
        "--set",
        f"produce.topic_prefix={prefix}",
        "--records",
        "200",
        "--variants",
        cfg.produce.variant.name,
        "--no-rss",
        "--repeats",
        "1",
    )
    _refusal(result, derived)
    assert admin.topic_partitions(cfg.kafka, derived) == [0]


def create_user_topic_like(cfg, topic: str) -> None:
    admin.create_topic(cfg.kafka, topic, 1)  # made by someone else: no manifest, no registry entry


def test_continuous_training_refuses_a_users_topic_without_a_heldout_topic(user_topic, profile, make_config):
    result = _kbit(
        "train",
        "--config",
        str(profile),
        "--set",
        "train.mode=continuous",
        "--set",
        f"stream.topic={user_topic}",
        "--set",
        "produce.variant.records_per_message=1",
        "--set",
        "kafka.client=confluent",
        "--set",
        "train.data=kafka",
    )
    assert result.exit_code != 0, result.output
    message = " ".join(result.output.split())
    assert f"stream topic '{user_topic}' was not written by kbit's live producer" in message, message
    assert f"source.topic={user_topic}" in message
    assert not admin.topic_exists(make_config().kafka, f"{user_topic}.heldout")


def test_inspect_shows_a_users_topic_as_it_is(user_topic, profile):
    result = _kbit("inspect", user_topic, "--config", str(profile), "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["kbit_created"] is False and facts["topic_id"]
    assert [(p["partition"], p["low"], p["high"]) for p in facts["partitions"]] == [(0, 0, 30), (1, 0, 30)]
    assert all(p["first_time"] and p["last_time"] for p in facts["partitions"])


def test_training_on_its_snapshot_writes_nothing(user_topic, profile):
    mapping = json.dumps(USER_MAPPING)
    result = _kbit(
        "inspect",
        user_topic,
        "--config",
        str(profile),
        "--set",
        f"source.topic={user_topic}",
        "--set",
        f"source.mapping={mapping}",
    )
    assert result.exit_code == 0, result.output  # inspect never snapshots: nothing recorded yet
    assert "no snapshot yet" in " ".join(result.output.split())

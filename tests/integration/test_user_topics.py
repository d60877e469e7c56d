"""A topic kbit did not write, on the real broker: snapshots (now, at a time, ranges), moved-on detection, splits by
time, and `kbit train` end to end on the user's own JSON field names."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from kbit_core.bench.dataplane import kafka_tools, ray_data_peer
from kbit_core.bench.dataplane.user_topic_bench import run_user_topic_bench
from kbit_core.cli import app
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.errors import ConfigError, CorruptRecordError, ManifestMismatchError
from kbit_core.jobs.benchmark import run_benchmark
from kbit_core.jobs.preflight import check_training
from kbit_core.jobs.train import train
from kbit_core.kafka.manifest import Manifest, manifest_path
from kbit_core.topic_dataset import snapshot_dataset
from tests.integration.user_topics import (
    USER_MAPPING,
    bootstrap,
    create_user_topic,
    end_offsets,
    fill_user_topic,
)

pytestmark = pytest.mark.kafka


def _user_config(make_config, topic, **dotted):
    return make_config({"source": {"topic": topic, "mapping": USER_MAPPING}, "tracking": {"enabled": False}}, **dotted)


def test_a_snapshot_covers_every_stored_record_and_indexes_them_by_position(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 300)
    cfg = _user_config(make_config, topic_name, shard__split_rates=[1.0])
    manifest = snapshot_dataset(cfg)
    assert manifest.source is not None and not manifest.kbit_wrote_it
    assert manifest.ranges() == {p: bounds for p, bounds in end_offsets(broker, topic_name).items()}
    assert manifest.num_records == 300 and manifest.source.vocabulary == ["cold", "hot"]
    assert manifest.dataset.num_classes == 2 and manifest.source.topic_id
    loader = make_split_loader(cfg.override({"train.global_batch_size": 10}), manifest, "train", 0, 1)
    seen = sorted(int(i) for batch in loader.iter_indexed() for i in batch.indices)
    assert seen == list(range(300))  # every record once, its index its place in the snapshot, not its key
    # reused by another workdir through the broker's manifest registry, unchanged
    other = _user_config(make_config, topic_name, shard__split_rates=[1.0], workdir=str(cfg.workdir) + "-other")
    assert snapshot_dataset(other) == manifest


def _two_periods(broker, topic: str, early_records: int, late_records: int) -> datetime:
    """A user's topic filled in two periods far apart; a time between them."""
    create_user_topic(broker, topic)
    early, late = 1_700_000_000_000, 1_800_000_000_000
    fill_user_topic(broker, topic, early_records, timestamp_ms=early)
    fill_user_topic(broker, topic, late_records, timestamp_ms=late, seed=1)
    return datetime.fromtimestamp((early + late) / 2000, UTC)


def test_a_snapshot_at_a_time_and_explicit_ranges(broker, make_config, topic_name):
    at = _two_periods(broker, topic_name, 100, 60)
    manifest = snapshot_dataset(_user_config(make_config, topic_name, source__at=at))
    assert manifest.ranges() == {0: (0, 50), 1: (0, 50)} and manifest.source.at == at
    ranged = snapshot_dataset(_user_config(make_config, topic_name, source__ranges=["1:10:19"], source__snapshot="new"))
    assert ranged.ranges() == {0: (0, 0), 1: (10, 20)} and ranged.num_records == 10


def test_a_split_by_time_trains_before_and_validates_after(broker, make_config, topic_name):
    split_time = _two_periods(broker, topic_name, 120, 80)
    cfg = _user_config(
        make_config, topic_name, shard__split_by="time", shard__split_times=[split_time], shard__split_rates=[0.5, 0.5]
    )
    manifest = snapshot_dataset(cfg)
    assert manifest.source.split_offsets == {0: [60], 1: [60]}
    loader = make_split_loader(cfg.override({"train.global_batch_size": 10}), manifest, "train", 0, 1)
    assert all(r.stop <= 60 for b in loader.schedule.blocks(0)[0] for r in [b.range])
    val = make_split_loader(cfg.override({"train.global_batch_size": 10}), manifest, "val", 0, 1)
    assert all(b.range.start >= 60 for b in val.schedule.blocks(0)[0])


def test_a_topic_that_moved_on_is_named_in_one_line(broker, make_config, topic_name, tmp_path):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 100)
    cfg = _user_config(make_config, topic_name)
    snapshot_dataset(cfg)
    fill_user_topic(broker, topic_name, 10, seed=3)  # appended records do not change the snapshot
    assert snapshot_dataset(cfg).num_records == 100
    from confluent_kafka import TopicPartition

    client = AdminClient({"bootstrap.servers": bootstrap(broker)})
    client.delete_records([TopicPartition(topic_name, 0, 20)])[TopicPartition(topic_name, 0, 20)].result(30)
    with pytest.raises(ManifestMismatchError) as exc:
        snapshot_dataset(cfg)
    message = str(exc.value)
    assert "\n" not in message and "moved on" in message and "partition 0: offsets 0..19 are deleted" in message
    assert "source.snapshot=new" in message
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(cfg.to_dict()))
    shown = CliRunner().invoke(app, ["inspect", topic_name, "--json", "--config", str(profile)])
    assert shown.exit_code == 1, shown.output  # inspect names how the topic moved on under its snapshot
    facts = json.loads(shown.stdout)
    assert facts["snapshot"]["records"] == 100 and "partition 0: offsets 0..19" in facts["snapshot"]["moved_on"][0]


def test_a_recreated_topic_is_named(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 50)
    cfg = _user_config(make_config, topic_name)
    snapshot_dataset(cfg)
    client = AdminClient({"bootstrap.servers": bootstrap(broker)})
    client.delete_topics([topic_name])[topic_name].result(30)
    _wait_gone(client, topic_name)
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 50)
    with pytest.raises(ManifestMismatchError, match="deleted and created again"):
        snapshot_dataset(cfg)


def test_a_mapping_that_does_not_fit_is_one_line_at_preflight(broker, make_config, topic_name):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 40)
    mapping = {**USER_MAPPING, "features": ["device.site"], "vocabulary": ["cold", "hot"]}
    cfg = make_config({"source": {"topic": topic_name, "mapping": mapping}})
    with pytest.raises(ConfigError) as exc:
        snapshot_dataset(cfg)
    message = str(exc.value)
    assert "\n" not in message and f"topic {topic_name!r} partition 0 offset 0" in message
    assert "'device.site' must hold numbers" in message
    assert not manifest_path(cfg.workdir, topic_name).exists()


@pytest.mark.slow
def test_kbit_train_on_a_users_json_topic_with_two_ranks(broker, make_config, topic_name):
    cfg = _two_ranks_on_a_filled_topic(
        broker,
        make_config,
        topic_name,
        1200,
        shard__split_rates=[0.8, 0.1, 0.1],
        train__epochs=3,
        train__global_batch_size=32,
        train__model={"name": "mlp", "kwargs": {"hidden": 32}},
        train__optim={"name": "adam", "lr": 0.01},
    )
    result = train(cfg, progress=False)
    assert result["topic"] == topic_name and result["world_size"] == 2
    assert result["test_accuracy"] >= 0.85, result
    assert Manifest.load(manifest_path(cfg.workdir, topic_name)).source is not None
    assert end_offsets(broker, topic_name) == {0: (0, 600), 1: (0, 600)}  # nothing written


def _two_ranks_on_a_filled_topic(broker, make_config, topic, records, **dotted):
    """A user's topic of ``records`` JSON records and a config training on it with 2 torchrun ranks."""
    create_user_topic(broker, topic)
    fill_user_topic(broker, topic, records)
    return _user_config(make_config, topic, launch__engine="torchrun", launch__num_processes=2, **dotted)


def _wait_gone(client: AdminClient, topic: str) -> None:
    import time

    for _ in range(100):
        if topic not in client.list_topics(timeout=10).topics:
            return
        time.sleep(0.1)


def test_bench_data_measures_a_users_topic_without_producing(broker, make_config, topic_name, tmp_path):
    create_user_topic(broker, topic_name)
    fill_user_topic(broker, topic_name, 400)
    cfg = _user_config(make_config, topic_name, train__global_batch_size=32, bench__clients=["confluent"])
    results = run_user_topic_bench(cfg, repeats=1)
    [row] = results["rows"]
    assert row["records"] == 400 and row["client"] == "confluent" and row["fetch_records_per_s"] > 0
    assert results["meta"]["topic"] == topic_name
    assert end_offsets(broker, topic_name) == {0: (0, 200), 1: (0, 200)}
    with pytest.raises(ConfigError, match="peers read a user's topic in the Confluent Avro framing only"):
        run_user_topic_bench(cfg, repeats=1, peers={"ray_read_kafka": ray_data_peer.compare})
    with pytest.raises(ConfigError, match="Kafka's performance tools measure kbit's own topics only"):
        run_user_topic_bench(cfg, repeats=1, peers={"kafka_tools": kafka_tools.compare})


def test_records_that_do_not_fit_are_named_or_skipped_and_counted(broker, make_config, topic_name):
    create_user_topic(broker, topic_name, partitions=1)
    fill_user_topic(broker, topic_name, 30, partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap(broker)})
    producer.produce(topic_name, b"not json", partition=0)  # offset 30
    producer.produce(topic_name, b'{"device": {"readings": "warm"}, "verdict": "hot"}', partition=0)  # offset 31
    assert producer.flush(10) == 0
    fill_user_topic(broker, topic_name, 8, partitions=1, seed=5)
    mapping = {**USER_MAPPING, "vocabulary": ["cold", "hot"]}
    cfg = make_config({"source": {"topic": topic_name, "mapping": mapping}}, shard__split_rates=[1.0])
    with pytest.raises(
        ConfigError, match=f"does not fit topic '{topic_name}' partition 0 offset 30: a value is not JSON"
    ):
        snapshot_dataset(cfg)  # at preflight, before any rank
    skipping = cfg.override({"train.global_batch_size": 8, "reader.bad_records": "skip"})
    manifest = snapshot_dataset(skipping)  # most records fit: the bad ones are skipped
    strict = make_split_loader(cfg.override({"train.global_batch_size": 8}), manifest, "train", 0, 1)
    with pytest.raises(CorruptRecordError) as exc:
        list(strict.iter_indexed())
    assert f"topic={topic_name}" in str(exc.value) and "partition=0" in str(exc.value) and "offset=30" in str(exc.value)
    loader = make_split_loader(skipping, manifest, "train", 0, 1)
    seen = {int(i) for batch in loader.iter_indexed() for i in batch.indices}
    assert loader.reader.stats.skipped == 2 and {30, 31}.isdisjoint(seen) and len(seen) == 38


@pytest.mark.slow
def test_kbit_bench_measures_a_users_topic_as_one_configuration(broker, make_config, topic_name, tmp_path):
    cfg = _two_ranks_on_a_filled_topic(
        broker,
        make_config,
        topic_name,
        300,
        train__global_batch_size=32,
        bench={"iterations": 1, "warmup_iterations": 0, "output_dir": str(tmp_path / "reports")},
        tracking__enabled=False,
    )
    result = run_benchmark(cfg, progress=False).to_dict()
    assert list(result["configurations"]) == ["json_list_none.confluent"]
    assert result["metadata"]["topics"] == {"json_list_none.confluent": topic_name}
    assert end_offsets(broker, topic_name) == {0: (0, 150), 1: (0, 150)}


def test_preflight_names_a_snapshot_too_small_for_its_splits(broker, make_config, topic_name):
    split_time = _two_periods(broker, topic_name, 40, 0)
    cfg = _user_config(
        make_config, topic_name, shard__split_by="time", shard__split_times=[split_time], shard__split_rates=[0.5, 0.5]
    )
    with pytest.raises(
        ConfigError, match=f"split 'val' gives each rank no message .*snapshot more of topic '{topic_name}'"
    ):
        check_training(cfg)

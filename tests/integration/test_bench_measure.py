"""The benchmark's timed region on one rank, through the real broker: how many Kafka clients it opens, and that
every stage, connect included, is measured where it happens."""

from __future__ import annotations

import pytest

from kbit_core.bench.loading.measure import COUNTERS, STAGES, Task, cell_config, time_loading
from kbit_core.data.split_loaders import make_split_loader, make_split_loaders
from kbit_core.sharding import SPLIT_NAMES, plan
from tests.integration.dataplane_fixtures import Produce, extended, inject

pytestmark = pytest.mark.kafka

RAW = {"format": "raw", "layout": "bytes", "compression": "lz4"}


@pytest.fixture
def opened_clients(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the Kafka client classes constructed while the test runs (the real clients, only counted)."""
    import confluent_kafka
    import kafka

    from kbit_core.kafka import admin

    opened: list[str] = []

    def counted(cls: type) -> type:
        class Counted(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs) -> None:
                opened.append(cls.__name__)
                super().__init__(*args, **kwargs)

        return Counted

    for module, name in (
        (confluent_kafka, "Consumer"),
        (admin, "Consumer"),
        (admin, "AdminClient"),
        (kafka, "KafkaConsumer"),
    ):
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    return opened


# The rank's one consumer checks all three splits' ranges itself (metadata + one probe fetch); a kafka-python
# rank asks them through one short-lived confluent client.
@pytest.mark.parametrize(
    ("client", "clients"), [("confluent", ["Consumer"]), ("kafka-python", ["Consumer", "KafkaConsumer"])]
)
def test_one_configuration_opens_the_clients_it_counts(produce_topic: Produce, opened_clients, client, clients):
    base, manifest = produce_topic(RAW, 301, partitions=3)
    cfg = cell_config(base, Task("raw_bytes_lz4", client, 16, manifest.model_dump_json()))
    opened_clients.clear()
    numbers, loaders = time_loading(cfg, manifest, 0, 2)
    loaders.close()
    assert sorted(opened_clients) == clients
    assert numbers["kafka_clients"] == len(opened_clients)

    stages = {s: numbers[f"{s}_s"] for s in STAGES}
    assert all(stages[s] > 0 for s in ("connect", "fetch", "decode", "collate")), stages
    assert stages["other"] >= 0 and sum(stages.values()) == pytest.approx(numbers["load_s"])

    expected = plan(manifest.ranges(), cfg.shard.split_rates, 2)
    shards = [expected.shard(s, 0) for s in SPLIT_NAMES]
    assert numbers["records"] == sum(s.num_records for s in shards)
    assert numbers["dropped_messages"] == sum(s.dropped for s in shards) > 0
    assert {c: numbers[c] for c in COUNTERS if c not in ("dropped_messages", "kafka_clients")} == {
        "skipped_messages": 0,
        "gap_offsets": 0,
        "padded_messages": 0,
        "padded_records": 0,
    }


def test_skipped_and_padded_records_reach_the_numbers(produce_topic: Produce):
    base, manifest = produce_topic(RAW, 40, partitions=2, reader__bad_records="skip", shard__split_rates=[0.5, 0.5])
    inject(base, manifest.topic, 1, b"not an image")
    bad = extended(manifest, 1, 1)
    cfg = cell_config(base, Task("raw", "confluent", 4, bad.model_dump_json()))
    numbers, loaders = time_loading(cfg, bad, 0, 1)
    loaders.close()
    assert numbers["skipped_messages"] == 1 and numbers["padded_records"] == 1
    assert numbers["kafka_clients"] == 1


def test_shared_reader_loaders_match_separate_loaders(produce_topic: Produce):
    cfg, manifest = produce_topic(RAW, 120, partitions=2, shard__block_records=8, train__global_batch_size=8)
    with make_split_loaders(cfg, manifest, 1, 2) as shared:
        assert list(shared) == list(SPLIT_NAMES)
        assert len({id(loader.reader) for loader in shared.values()}) == 1
        shared.connect()
        # train and val interleaved on one consumer, as a validation pass inside an epoch would
        train, val = shared["train"].iter_indexed(), shared["val"].iter_indexed()
        got = {"train": [next(train).indices.tolist()], "val": [b.indices.tolist() for b in val]}
        got["train"] += [b.indices.tolist() for b in train]
        got["test"] = [b.indices.tolist() for b in shared["test"].iter_indexed()]
        assert shared.reader.stats.kafka_clients == 1  # the consumer, which also checked all three splits' ranges
    for split in SPLIT_NAMES:
        with make_split_loader(cfg, manifest, split, 1, 2) as alone:
            assert got[split] == [b.indices.tolist() for b in alone.iter_indexed()], split

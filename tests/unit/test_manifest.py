"""The offset manifest (ranges, the original's inclusive strings, identity, save/load) and the delivery ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from rich.console import Console

from kbit_core.cli.topic_view import partitions_table
from kbit_core.config import DataVariant, KafkaConfig
from kbit_core.errors import BrokerError, TopicError
from kbit_core.kafka.contents import TopicCheck
from kbit_core.kafka.manifest import DataIdentity, DatasetInfo, Manifest, PartitionManifest, manifest_path
from kbit_core.kafka.producers import DeliveryLedger
from tests.conftest import free_port

DATASET = DatasetInfo(name="synthetic_digits", seed=0, num_records=10, image_shape=(1, 28, 28), num_classes=10)


def part(p: int, first: int, messages: int, records: int | None = None) -> PartitionManifest:
    return PartitionManifest(
        partition=p,
        first_offset=first,
        last_offset=first + messages - 1,
        num_messages=messages,
        num_records=messages if records is None else records,
        value_bytes=100 * messages,
    )


def manifest(**changes) -> Manifest:
    parts = changes.pop("partitions", [part(0, 0, 4), part(1, 5, 3), part(2, 0, 0)])
    fields = dict(
        topic="kbit.test.v1",
        dataset=DATASET,
        variant=DataVariant(),
        schema_fingerprint="abc123",
        partitions=parts,
        num_messages=sum(p.num_messages for p in parts),
        num_records=sum(p.num_records for p in parts),
        value_bytes=sum(p.value_bytes for p in parts),
        wire_bytes=None,
        produce_seconds=0.5,
        client="confluent",
        kbit_version="0.1.0",
    )
    fields.update(changes)
    return Manifest(**fields)


def test_ranges_are_half_open_and_offset_strings_inclusive() -> None:
    m = manifest()
    assert m.ranges() == {0: (0, 4), 1: (5, 8), 2: (0, 0)}
    assert m.offset_strings() == ["0:0:3", "1:5:7", "2:0:-1"]


def test_partition_offsets_must_hold_exactly_its_messages() -> None:
    with pytest.raises(ValidationError, match="do not hold exactly 3 messages"):
        PartitionManifest(partition=0, first_offset=0, last_offset=5, num_messages=3, num_records=3, value_bytes=1)


def test_totals_must_add_up_over_partitions() -> None:
    with pytest.raises(ValidationError, match="num_records=99 but the partitions add up to 7"):
        manifest(num_records=99)


def test_partitions_must_be_numbered_from_zero_in_order() -> None:
    with pytest.raises(ValidationError, match=r"0..n-1 in order, got \[1, 0\]"):
        manifest(partitions=[part(1, 0, 2), part(0, 0, 2)])


def test_topic_name_cannot_escape_the_manifest_directory() -> None:
    with pytest.raises(ValidationError, match="topic"):
        manifest(topic="../etc/passwd")


def test_same_identity_matches_despite_different_timing_and_client() -> None:
    assert manifest().matches(manifest(produce_seconds=9.0, client="kafka-python", wire_bytes=123)) == []


def test_matches_lists_each_identity_difference() -> None:
    other = manifest(
        variant=DataVariant(compression="none"),
        schema_fingerprint="zzz",
        dataset=DATASET.model_copy(update={"seed": 7}),
        partitions=[part(0, 0, 4), part(1, 0, 3)],
    )
    diffs = manifest().matches(other)
    assert diffs == [
        "dataset.seed: 0 != 7",
        "variant.compression: 'lz4' != 'none'",
        "partitions: 3 != 2",
        "schema_fingerprint: abc123 != zzz",
    ]


def test_matches_accepts_a_requested_identity() -> None:
    request = DataIdentity(
        dataset=DATASET, variant=DataVariant(records_per_message=4), partitions=3, schema_fingerprint="abc123"
    )
    assert manifest().matches(request) == ["variant.records_per_message: 1 != 4"]


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    m = manifest(wire_bytes=1234)
    path = m.save(tmp_path / "kbit" / "manifests")
    assert path == manifest_path(tmp_path / "kbit", m.topic)
    assert Manifest.load(path) == m
    assert json.loads(path.read_text())["partitions"][1] == {
        "partition": 1,
        "first_offset": 5,
        "last_offset": 7,
        "num_messages": 3,
        "num_records": 3,
        "value_bytes": 300,
        "content_digest": None,
    }
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_load_names_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(TopicError, match="no manifest at .*absent.json"):
        Manifest.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"topic": "x"}))
    with pytest.raises(TopicError, match=r"manifest .*bad.json is invalid"):
        Manifest.load(bad)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 40), st.integers(1, 4), st.randoms(use_true_random=False))
def test_ledger_turns_out_of_order_deliveries_into_exact_partitions(
    partitions: int, messages: int, per_message: int, rng
) -> None:
    """Message m goes to partition m % P at the next offset there; reports may arrive in any order (client threads)."""
    reports = []
    next_offset = [0] * partitions
    for m in range(messages):
        p = m % partitions
        reports.append((p, next_offset[p], per_message, 10 + m))
        next_offset[p] += 1
    rng.shuffle(reports)
    ledger = DeliveryLedger("t", partitions)
    for p, offset, records, size in reports:
        ledger.callback(records, size)(p, offset, None)
    parts = ledger.partitions()
    assert [(x.first_offset, x.stop_offset, x.num_messages) for x in parts] == [(0, n, n) for n in next_offset]
    assert ledger.delivered_records == messages * per_message
    assert sum(x.value_bytes for x in parts) == sum(10 + m for m in range(messages))


def test_ledger_names_each_failed_partition() -> None:
    ledger = DeliveryLedger("topic-a", 3)
    ledger.callback(1, 5)(0, 0, None)
    ledger.callback(1, 5)(2, -1, "Broker: Message size too large")
    ledger.callback(1, 5)(2, -1, "Broker: Message size too large")
    with pytest.raises(BrokerError, match=r"topic-a\[2\]: 2 message\(s\) failed, first error: Broker: Message size"):
        ledger.partitions()


def test_ledger_keeps_the_clients_error_when_the_cluster_cannot_say_why() -> None:
    """With the cluster's settings the ledger asks for the failed partitions' in-sync replicas; a cluster that does
    not answer (nothing listens there) leaves the one-line error as the client gave it."""
    kcfg = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", request_timeout_s=1)
    ledger = DeliveryLedger("topic-c", 2, kcfg)
    ledger.callback(1, 5)(1, -1, "Local: Message timed out")
    with pytest.raises(BrokerError) as caught:
        ledger.raise_errors()
    assert (
        str(caught.value) == "delivery failed: topic-c[1]: 1 message(s) failed, first error: Local: Message timed out"
    )


def test_ledger_refuses_offsets_with_gaps() -> None:
    ledger = DeliveryLedger("topic-b", 1)
    for offset in (0, 1, 3):
        ledger.callback(1, 5)(0, offset, None)
    with pytest.raises(TopicError, match=r"topic-b\[0\]: 3 messages landed at offsets 0..3, which are not contiguous"):
        ledger.partitions()


def test_inspects_live_check_fits_80_columns() -> None:
    """Issue 21: at 80 columns inspect's live column was cut off."""
    big = [part(0, 0, 29_999, 59_998), part(1, 0, 29_999, 59_998)]
    check = TopicCheck(
        "kbit.test.v1",
        True,
        [0, 1],
        earliest={0: 0, 1: 0},
        ends={0: 29_999, 1: 30_000},
        problems=["x"],
        differing=frozenset({1}),
    )
    console = Console(width=80, record=True, color_system=None)
    console.print(partitions_table(manifest(partitions=big), check))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text and " live " in text and "differs" in text and " ok " in text
    assert "0..29998" in text and "29,999" in text

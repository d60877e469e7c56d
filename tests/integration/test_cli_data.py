"""`kbit produce` and `kbit inspect` through the real CLI app, against the embedded broker."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Producer
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.config import KbitConfig
from kbit_core.kafka import admin
from tests.conftest import free_port

pytestmark = pytest.mark.kafka

runner = CliRunner()


def flat(text: str) -> str:
    """Output with rich's line wrapping undone (the runner's console is 80 columns wide)."""
    return " ".join(text.split())


@pytest.fixture
def profile(make_config: Callable[..., KbitConfig], tmp_path: Path, topic_name: str) -> Iterator[Path]:
    """A YAML profile pointing at the test broker; the flags under test override its dataset and variant."""
    cfg = make_config(dataset__num_records=1000, produce__partitions=1)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    yield path
    admin.delete_topic(cfg.kafka, topic_name)


def produce(profile: Path, topic: str, *extra: str):
    return runner.invoke(
        app,
        [
            "produce",
            "--config",
            str(profile),
            "--format",
            "raw",
            "--layout",
            "bytes",
            "--compression",
            "lz4",
            "--records",
            "11",
            "--partitions",
            "2",
            "--topic",
            topic,
            "--records-per-message",
            "2",
            *extra,
        ],
    )


def test_produce_flags_override_the_profile_and_inspect_confirms(profile: Path, topic_name: str) -> None:
    result = produce(profile, topic_name, "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["topic"] == topic_name and manifest["num_records"] == 11 and manifest["num_messages"] == 6
    assert manifest["variant"] == {"format": "raw", "layout": "bytes", "compression": "lz4", "records_per_message": 2}
    assert [(p["first_offset"], p["last_offset"]) for p in manifest["partitions"]] == [(0, 2), (0, 2)]
    assert Path(manifest["manifest_path"]).is_file()

    inspected = runner.invoke(app, ["inspect", topic_name, "--config", str(profile), "--json"])
    assert inspected.exit_code == 0, inspected.output
    report = json.loads(inspected.stdout)
    assert report["ok"] is True and report["ends"] == {"0": 3, "1": 3} and report["problems"] == []

    table = runner.invoke(app, ["inspect", topic_name, "--config", str(profile)])
    assert table.exit_code == 0 and f"topic {topic_name} holds exactly its manifest" in flat(table.stdout)
    assert "0:0:2 1:0:2" in flat(table.stdout)


def test_produce_prints_tables_and_reuses(profile: Path, topic_name: str) -> None:
    first = produce(profile, topic_name)
    assert first.exit_code == 0, first.output
    assert "raw_bytes_lz4_x2" in flat(first.stdout) and "partitions" in flat(first.stdout)
    second = produce(profile, topic_name, "--client", "kafka-python")
    assert second.exit_code == 0  # the client is not part of the data's identity: reused
    assert "(confluent)" in flat(second.stdout)


def test_produce_mismatch_is_a_clear_error_until_recreate(profile: Path, topic_name: str) -> None:
    assert produce(profile, topic_name).exit_code == 0
    changed = produce(profile, topic_name, "--set", "dataset.seed=3")
    assert changed.exit_code == 1
    assert "dataset.seed: 0 != 3" in flat(changed.stderr) and "Traceback" not in changed.output
    assert produce(profile, topic_name, "--set", "dataset.seed=3", "--recreate").exit_code == 0


def test_inspect_flags_a_topic_that_no_longer_holds_its_manifest(profile: Path, topic_name: str) -> None:
    assert produce(profile, topic_name).exit_code == 0
    cfg = KbitConfig.from_dict(yaml.safe_load(profile.read_text()))
    stray = Producer({"bootstrap.servers": cfg.kafka.resolved_bootstrap()})
    stray.produce(topic_name, value=b"stray", partition=0)
    assert stray.flush(10) == 0
    result = runner.invoke(app, ["inspect", topic_name, "--config", str(profile)])
    assert result.exit_code == 1
    assert "partition 0: the broker ends at offset 4, the manifest at 3" in flat(result.stdout)
    assert "differs" in flat(result.stdout).split("partition 0:")[0]  # the partitions table marks it too


def test_inspect_unknown_topic(profile: Path, topic_name: str) -> None:
    result = runner.invoke(app, ["inspect", topic_name, "--config", str(profile)])
    assert result.exit_code == 1
    error = flat(result.stderr)
    assert f"topic '{topic_name}' is not on the embedded broker" in error and "kbit produce" in error


def test_commands_tell_the_user_to_start_the_stack(profile: Path, topic_name: str) -> None:
    down = ["--set", f"kafka.embedded.port={free_port()}"]
    for args in (["inspect", topic_name], ["produce", "--records", "3", "--topic", topic_name]):
        result = runner.invoke(app, [*args, "--config", str(profile), *down])
        assert result.exit_code == 1, args
        assert "kbit stack up" in flat(result.stderr)


def test_bad_flag_value_names_the_field(profile: Path, topic_name: str) -> None:
    result = produce(profile, topic_name, "--set", "produce.variant.compression=brotli")
    assert result.exit_code == 0  # the explicit --compression flag wins over --set
    result = runner.invoke(app, ["produce", "--config", str(profile), "--compression", "brotli"])
    assert result.exit_code == 1 and "produce.variant.compression" in flat(result.stderr)

"""The stack's Schema Registry: `kbit stack up` starts kbit's Apicurio Registry when the profile asks for it, on
127.0.0.1, reports it, keeps file-backed schemas across a restart, and stops it by PID."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from kbit_core.config import KbitConfig
from kbit_core.stack import LocalStack
from tests.conftest import free_port, require_schema_registry

pytestmark = pytest.mark.kafka


def test_stack_up_starts_the_registry_and_file_storage_outlives_a_restart(tmp_path: Path) -> None:
    require_schema_registry()
    port = free_port()
    cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "kbit"),
            "kafka": {"embedded": {"port": free_port(), "controller_port": free_port()}},
            "registry": {"local": {"enabled": True, "port": port, "management_port": free_port(), "storage": "file"}},
        }
    )
    stack = LocalStack(cfg)
    try:
        services = {s.name: s for s in stack.up(broker_only=True)}
        registry = services["schema-registry"]
        assert registry.running and registry.url == f"http://127.0.0.1:{port}/apis/ccompat/v7"
        schema = Schema(json.dumps({"type": "record", "name": "A", "fields": [{"name": "x", "type": "int"}]}), "AVRO")
        schema_id = SchemaRegistryClient({"url": registry.url}).register_schema("kept-value", schema)
        assert "schema-registry" in stack.down()

        stack.up(broker_only=True)
        again = SchemaRegistryClient({"url": registry.url})
        assert again.get_latest_version("kept-value").schema_id == schema_id
        assert (tmp_path / "kbit" / "registry").is_dir()
    finally:
        stack.down()
    assert stack.registry is not None and stack.registry.pid() is None

"""Pure units of the Schema Registry support: the Confluent framing's parsing, the registry settings (credentials
masked like the Kafka password), the Java the local registry needs, and the decoders that take a schema file or a
Protobuf descriptor set (no registry)."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import fastavro
import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from kbit_core.brokers.schema_registry import RegistryServiceError, find_java
from kbit_core.config import KbitConfig, RegistryConfig
from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats.confluent import avro_file_decoder, protobuf_descriptor_decoder
from kbit_core.formats.confluent.framing import FramingError, frame, message_indexes, schema_id
from kbit_core.formats.schemas import kbit_pb2
from kbit_core.tracking.params import config_params


def test_the_header_gives_the_schema_id_and_refuses_other_framings() -> None:
    assert schema_id(frame(70000, b"x")) == 70000
    for value, reason in ((b"\x00\x00\x01", "too short"), (b"\x01\x00\x00\x00\x01x", "magic byte"), (None, "null")):
        with pytest.raises(FramingError, match=reason):
            schema_id(value)


def test_protobuf_message_indexes() -> None:
    assert message_indexes(frame(1, b"\x00rest")) == ([0], 6)
    assert message_indexes(frame(1, b"\x04\x02\x06msg")) == ([1, 3], 8)  # zigzag: count 2, indexes 1 and 3
    with pytest.raises(FramingError, match="run past"):
        message_indexes(frame(1, b"\x04\x02"))
    with pytest.raises(FramingError, match="negative"):
        message_indexes(frame(1, b"\x02\x01"))


def test_registry_credentials_are_masked_and_revealed_only_for_clients() -> None:
    cfg = KbitConfig.from_dict(
        {"registry": {"url": "https://sr.example:8081", "username": "u", "password": "hunter2", "ssl_cafile": "ca.pem"}}
    )
    assert "hunter2" not in str(cfg.to_dict()) and "hunter2" not in repr(cfg)
    assert "hunter2" not in str(config_params(cfg))
    assert cfg.to_secret_dict()["registry"]["password"] == "hunter2"
    assert KbitConfig.from_json(cfg.to_secret_json()).registry.client_conf()["basic.auth.user.info"] == "u:hunter2"
    token = RegistryConfig(url="http://sr:8081", bearer_token="t0ken").client_conf()
    assert token["bearer.auth.token"] == "t0ken" and token["bearer.auth.credentials.source"] == "STATIC_TOKEN"
    assert "t0ken" not in str(RegistryConfig(url="http://sr:8081", bearer_token="t0ken").model_dump())


def test_registry_settings_refuse_what_cannot_work() -> None:
    for bad, reason in (
        ({"password": "p"}, "without registry.username"),
        ({"username": "u", "bearer_token": "t"}, "exclude each other"),
        ({"url": "http://sr:8081", "ssl_cafile": "ca.pem"}, "not an https:// URL"),
        ({"url": "sr:8081"}, "http:// or https://"),
    ):
        with pytest.raises(ConfigError, match=reason):
            KbitConfig.from_dict({"registry": bad})
    assert not RegistryConfig().enabled
    assert (
        RegistryConfig(local={"enabled": True, "port": 1234}).resolved_url() == "http://127.0.0.1:1234/apis/ccompat/v7"
    )


def fake_java(tmp_path: Path, major: int) -> Path:
    java = tmp_path / f"java{major}"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{major}.0.1\"' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return java


def test_the_registry_java_is_21_or_newer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_java(fake_java(tmp_path, 25)) == str(tmp_path / "java25")
    with pytest.raises(RegistryServiceError, match="needs Java 21\\+; registry.local.java=.*java17 is Java 17"):
        find_java(fake_java(tmp_path, 17))
    monkeypatch.setenv("KBIT_REGISTRY_JAVA", str(tmp_path / "missing"))
    with pytest.raises(RegistryServiceError, match="KBIT_REGISTRY_JAVA=.*missing does not run"):
        find_java()


def test_nothing_21_found_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KBIT_REGISTRY_JAVA", raising=False)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk17"))
    (tmp_path / "jdk17" / "bin").mkdir(parents=True)
    os.symlink(fake_java(tmp_path, 17), tmp_path / "jdk17" / "bin" / "java")
    monkeypatch.setattr("kbit_core.brokers.schema_registry.JVM_ROOT", tmp_path / "no-jvms")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RegistryServiceError) as exc:
        find_java()
    assert "\n" not in str(exc.value) and "JAVA_HOME=" in str(exc.value) and "Java 17" in str(exc.value)


SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [
        {"name": "x", "type": "long"},
        {"name": "v", "type": {"type": "array", "items": "double"}},
        {"name": "tag", "type": ["null", "string"]},
    ],
}


def test_avro_with_a_schema_file_resolved_to_a_reader_schema(tmp_path: Path) -> None:
    writer, reader = tmp_path / "w.avsc", tmp_path / "r.avsc"
    writer.write_text(json.dumps(SCHEMA))
    reader.write_text(json.dumps({**SCHEMA, "fields": [*SCHEMA["fields"], {"name": "w", "type": "int", "default": 7}]}))
    rows = [{"x": i, "v": [i / 3, -i], "tag": None if i % 2 else str(i)} for i in range(20)]
    values = []
    for row in rows:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, fastavro.parse_schema(SCHEMA), row)
        values.append(out.getvalue())
    for decoder in ("fast", "stock"):
        columns = avro_file_decoder(writer, reader, decoder).decode_columns(values, ["x", "v", "tag", "w"])
        assert np.asarray(columns["x"]).tolist() == list(range(20))
        assert np.asarray(columns["v"]).tolist() == [r["v"] for r in rows]
        assert columns["tag"] == [r["tag"] for r in rows] and list(columns["w"]) == [7] * 20
    decoder = avro_file_decoder(writer)
    assert decoder.writer_schema().fields["tag"].nullable
    with pytest.raises(CorruptRecordError, match="value 1 of 2 cannot be decoded"):
        decoder.decode_columns([values[0], values[1][:3]], ["x"])
    with pytest.raises(ConfigError, match="cannot be read as an Avro schema"):
        avro_file_decoder(tmp_path / "absent.avsc")


def test_protobuf_with_a_descriptor_set(tmp_path: Path) -> None:
    descriptor_set = tmp_path / "kbit.desc"
    proto = descriptor_pb2.FileDescriptorProto()
    kbit_pb2.DESCRIPTOR.CopyToProto(proto)
    descriptor_set.write_bytes(descriptor_pb2.FileDescriptorSet(file=[proto]).SerializeToString())
    decoder = protobuf_descriptor_decoder(descriptor_set, "kbit.Sample")
    values = [kbit_pb2.Sample(index=i, label=3, shape=[2], pixels=b"ab").SerializeToString() for i in range(3)]
    assert decoder.decode_columns(values, ["index", "pixels", "shape"]) == {
        "index": [0, 1, 2],
        "pixels": [b"ab"] * 3,
        "shape": [[2]] * 3,
    }
    assert decoder.writer_schema().fields["shape"].kind == "array<int>"
    with pytest.raises(CorruptRecordError, match="value 0 of 1"):
        decoder.decode_columns([b"\xff\xff"], ["index"])
    with pytest.raises(ConfigError, match="has no message 'kbit.Nope'.*kbit.Sample"):
        protobuf_descriptor_decoder(descriptor_set, "kbit.Nope")

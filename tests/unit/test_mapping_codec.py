"""The mapping from a user's records to tensors (MappedCodec over a RecordDecoder) and its checks, without a broker."""

from __future__ import annotations

import base64
import pickle

import numpy as np
import orjson
import pytest

from kbit_core.config import MappingConfig
from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats.decoders import RECORD_DECODERS, make_record_decoder
from kbit_core.formats.json_records import JsonRecordDecoder
from kbit_core.formats.mapping import MappedCodec, NullFieldSkipped
from kbit_core.formats.records import FieldType, WriterSchema, field_at
from kbit_core.kafka.consumers import MessageRecord, RawRecord
from kbit_core.topic_dataset import check_against_schema, check_message_fields


def codec(vocabulary=None, num_classes=None, **mapping) -> MappedCodec:
    spec = MappingConfig.model_validate({"features": ["x.values"], "shape": [2, 2], "label": "y", **mapping})
    return MappedCodec(
        JsonRecordDecoder(), spec, {0: (0, 0), 1: (5, 10)}, vocabulary=vocabulary, num_classes=num_classes
    )


def values(*docs) -> list[bytes]:
    return [orjson.dumps(d) for d in docs]


def test_an_array_field_and_a_string_label_become_a_batch():
    batch = codec(["cat", "dog"]).decode(
        values({"x": {"values": [1, 2, 3, 4]}, "y": "dog"}, {"x": {"values": [0.5, 0, 0, 1]}, "y": "cat"})
    )
    assert batch.pixels.dtype == np.float32 and batch.pixels.shape == (2, 2, 2)
    assert batch.pixels[0].tolist() == [[1, 2], [3, 4]] and batch.labels.tolist() == [1, 0]


def test_indices_come_from_partition_and_offset_not_from_the_record():
    c = codec(num_classes=3)
    batch = c.decode(values(*[{"x": {"values": [0, 0, 0, 0]}, "y": 2}] * 3))
    records = [RawRecord(0, 3, None), RawRecord(1, 5, None), RawRecord(1, 7, None)]
    assert c.indexed(batch, records).indices.tolist() == [3, 10, 12]


def test_stacked_scalars_and_base64_bytes():
    spec = MappingConfig(features=["a", "b.c"], label="y", num_classes=2)
    batch = MappedCodec(JsonRecordDecoder(), spec, {0: (0, 0)}, num_classes=2).decode(
        values({"a": 1.5, "b": {"c": -2}, "y": 1})
    )
    assert batch.pixels.tolist() == [[1.5, -2.0]]
    raw = bytes(range(4))
    c = codec(num_classes=2, encoding="base64", dtype="uint8")
    batch = c.decode(values({"x": {"values": base64.b64encode(raw).decode()}, "y": 0}))
    assert batch.pixels.dtype == np.uint8 and batch.pixels.reshape(-1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"x": {"values": ["a", "b", "c", "d"]}, "y": "cat"}, "'x.values' must hold numbers"),
        ({"x": {"values": [1, 2, 3]}, "y": "cat"}, "hold 3 values, source.mapping.shape \\[2, 2\\] needs 4"),
        ({"x": {"values": [1, 2, 3, 4]}, "y": "bird"}, "label 'bird' of field 'y' is not in the vocabulary"),
        ({"x": {"values": [1, 2, 3, 4]}}, "the label field 'y' is null or missing"),
        ({"y": "cat"}, "the feature field 'x.values' is null or missing \\(source.mapping.nulls: error\\)"),
    ],
)
def test_a_record_that_does_not_fit_is_one_line_naming_the_field(doc, match):
    with pytest.raises(CorruptRecordError, match=match) as exc:
        codec(["cat", "dog"]).decode(values({"x": {"values": [0, 0, 0, 0]}, "y": "cat"}, doc))
    assert "\n" not in str(exc.value) and "value 1 of 2" in str(exc.value)


def test_integers_out_of_the_dtypes_range_or_fractions_are_refused():
    with pytest.raises(CorruptRecordError, match="outside uint8's range"):
        codec(num_classes=2, dtype="uint8").decode(values({"x": {"values": [0, 1, 2, 256]}, "y": 0}))
    with pytest.raises(CorruptRecordError, match="holds fractions"):
        codec(num_classes=2, dtype="uint16").decode(values({"x": {"values": [0, 1, 2, 0.5]}, "y": 0}))
    with pytest.raises(CorruptRecordError, match="label 5 of record 0 is not \\[0, 2\\)"):
        codec(num_classes=2).decode(values({"x": {"values": [0, 1, 2, 3]}, "y": 5}))


def test_nulls_are_filled_or_skipped_as_the_mapping_says():
    docs = values({"x": {"values": None}, "y": 1})
    assert codec(num_classes=2, nulls="fill", fill=7).decode(docs).pixels.reshape(-1).tolist() == [7] * 4
    skipping = codec(num_classes=2, nulls="skip")
    [(position, reason)] = list(skipping.failing_values(docs))
    assert position == 0 and isinstance(reason, NullFieldSkipped) and skipping.skips(reason)
    assert not codec(num_classes=2).skips(ValueError("x"))


def test_it_pickles_for_decode_workers_and_never_encodes():
    c = codec(["cat", "dog"])
    again = pickle.loads(pickle.dumps(c))
    assert again.schema_fingerprint() == c.schema_fingerprint() and again.vocabulary == ["cat", "dog"]
    assert codec(["cat", "dog", "eel"]).schema_fingerprint() != c.schema_fingerprint()
    with pytest.raises(TypeError, match="never writes a topic it did not create"):
        c.encode(np.zeros(1, np.int64), np.zeros((1, 2, 2), np.float32), np.zeros(1, np.int64))


def test_the_json_decoder_finds_dotted_paths_and_refuses_what_is_not_json():
    assert field_at({"a": {"b": [1]}}, "a.b") == [1] and field_at({"a": 3}, "a.b") is None
    decoder = make_record_decoder("json", {}, topic="t")
    assert decoder.writer_schema() is None
    assert decoder.decode_columns(values({"a": {"b": 1}}, {}), ["a.b", "z"]) == {"a.b": [1, None], "z": [None, None]}
    with pytest.raises(CorruptRecordError, match="not JSON"):
        decoder.decode_columns([b"\x00\x00\x00\x00\x01xx"], ["a"])


def test_the_decoder_factory_is_keyed_by_value_format():
    assert RECORD_DECODERS["json"] is JsonRecordDecoder
    known = "avro, confluent-avro, confluent-json, confluent-protobuf, json, protobuf"
    with pytest.raises(ConfigError, match=f"source.value_format 'avro-file' is unknown; known: {known}"):
        make_record_decoder("avro-file", {}, topic="t")
    with pytest.raises(ConfigError, match="value format 'json' takes none"):
        make_record_decoder("json", {"schema": "x.avsc"}, topic="t")
    with pytest.raises(ConfigError, match="Confluent framing: set registry.url"):
        make_record_decoder("confluent-avro", {}, topic="t")


def test_a_mapping_is_checked_against_the_writer_schema_naming_field_subject_and_id():
    schema = WriterSchema(
        source="registry http://127.0.0.1:8081 subject t-value id 3",
        fields={"x.values": FieldType("x.values", "array<float>"), "y": FieldType("y", "float")},
        subject="t-value",
        schema_id=3,
    )
    spec = MappingConfig(features=["x.values"], shape=[2, 2], label="y")
    with pytest.raises(
        ConfigError, match="field 'y' is float in the writer schema, the mapping needs int or string"
    ) as exc:
        check_against_schema(spec, schema)
    assert "subject t-value, schema id 3" in str(exc.value)
    with pytest.raises(
        ConfigError, match="field 'x.pixels' is not in the writer schema \\(subject t-value, schema id 3"
    ):
        check_against_schema(spec.model_copy(update={"features": ["x.pixels"]}), schema)


def _message(value, key=None, headers=None, timestamp=-1, offset=0) -> MessageRecord:
    return MessageRecord(0, offset, orjson.dumps(value) if value is not None else None, key, headers, timestamp)


def test_key_headers_and_timestamp_become_features_and_labels():
    spec = MappingConfig(
        features=["a", "@timestamp", "@header.region"], label="@key", header_format="int32", key_format="string"
    )
    c = MappedCodec(JsonRecordDecoder(), spec, {0: (0, 0)}, vocabulary=["cat", "dog"])
    assert c.reads_metadata and spec.value_fields == ["a"]
    records = [
        _message({"a": 1.5}, b"dog", [("region", b"\x00\x00\x00\x07"), ("other", b"x")], 1000),
        _message({"a": 2}, b"cat", [("region", b"\x00\x00\x00\x01"), ("region", b"\xff\xff\xff\xfe")], 2000),
    ]
    batch = c.decode(c.decode_inputs(records))
    assert batch.labels.tolist() == [1, 0]
    assert batch.pixels.tolist() == [[1.5, 1000, 7], [2, 2000, -2]]  # a repeated header gives its last value
    assert c.indexed(batch, records).indices.tolist() == [0, 0]


def test_a_mapping_of_key_bytes_alone_needs_no_value():
    spec = MappingConfig(
        key_format="bytes",
        features=["@key"],
        encoding="bytes",
        shape=[2],
        dtype="uint8",
        label="@header.y",
        header_format="int",
    )
    c = MappedCodec(JsonRecordDecoder(), spec, {0: (0, 0)}, num_classes=10)
    batch = c.decode([_message(None, b"\x01\x02", [("y", b"7")])])  # a tombstone's key and headers still map
    assert batch.pixels.tolist() == [[1, 2]] and batch.labels.tolist() == [7]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (_message({"a": 1}, None, [("region", b"\x00\x00\x00\x07")]), "the label field '@key' is null or missing"),
        (_message({"a": 1}, b"dog"), "the feature field '@header.region' is null or missing"),
        (_message({"a": 1}, b"\xff", [("region", b"\x00\x00\x00\x07")]), "field '@key' is not UTF-8 text"),
        (_message({"a": 1}, b"dog", [("region", b"\x07")]), "field '@header.region' holds 1 bytes, int32 needs 4"),
    ],
)
def test_a_null_or_unreadable_key_or_header_is_a_bad_record_naming_the_field(record, match):
    spec = MappingConfig(features=["a", "@header.region"], label="@key", header_format="int32")
    c = MappedCodec(JsonRecordDecoder(), spec, {0: (0, 0)}, vocabulary=["cat", "dog"])
    with pytest.raises(CorruptRecordError, match=match) as exc:
        c.decode([_message({"a": 1}, b"cat", [("region", b"\x00\x00\x00\x01")]), record])
    assert "\n" not in str(exc.value) and "value 1 of 2" in str(exc.value)
    filled = MappedCodec(
        JsonRecordDecoder(), spec.model_copy(update={"nulls": "fill"}), {0: (0, 0)}, vocabulary=["cat", "dog"]
    )
    assert filled.decode([_message({"a": 1}, b"dog", timestamp=5)]).pixels.tolist() == [[1, 0]]


def test_message_fields_are_named_and_their_kinds_checked_before_reading():
    with pytest.raises(ValueError, match="field '@offset' names no part of a message; use @key, @timestamp"):
        MappingConfig(features=["a"], label="@offset")
    with pytest.raises(ValueError, match="names no part of a message"):
        MappingConfig(features=["@header."], label="y")
    with pytest.raises(
        ConfigError,
        match="field '@key' is bytes \\(source.mapping.key_format: bytes\\), the mapping needs int or string",
    ):
        check_message_fields(MappingConfig(features=["a"], label="@key", key_format="bytes"))
    with pytest.raises(ConfigError, match="field '@timestamp' is int, the mapping needs bytes"):
        check_message_fields(MappingConfig(features=["@timestamp"], encoding="bytes", shape=[8], label="y"))
    check_message_fields(MappingConfig(features=["@key"], encoding="base64", shape=[8], label="@header.h"))
    # a schema check leaves the message's fields to check_message_fields
    schema = WriterSchema(source="s", fields={"a": FieldType("a", "float")}, subject="t-value", schema_id=1)
    check_against_schema(MappingConfig(features=["a", "@timestamp"], label="@key"), schema)


def test_a_mapping_without_message_fields_keeps_its_fingerprint_and_reads_values():
    plain = codec(["cat", "dog"])
    assert not plain.reads_metadata and plain.decode_inputs([RawRecord(0, 1, b"v")]) == [b"v"]
    assert "key_format" not in plain._definition()

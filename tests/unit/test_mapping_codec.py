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
from kbit_core.kafka.consumers import RawRecord
from kbit_core.topic_dataset import check_against_schema


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

"""Codecs: exact round trips, strict refusal of damaged or foreign values, stable distinct fingerprints."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import bson
import fastavro
import numpy as np
import orjson
import pytest

from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats import Codec, codec_names, get_codec, supported
from kbit_core.formats.avro_codec import load_avro_schema
from kbit_core.formats.microbench import decode_rates
from kbit_core.formats.schemas import kbit_pb2

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(1, 28, 28), (3, 32, 32)]


def samples(shape: tuple[int, ...], n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    flat = images.reshape(n, int(np.prod(shape)))
    flat[:, 0], flat[:, -1] = 0, 255  # the extremes of the pixel range must survive too
    return np.arange(1000, 1000 + n, dtype=np.int64), images, rng.integers(0, 10, n)


def check_round_trip(codec: Codec, n: int = 9) -> None:
    indices, images, labels = samples(codec.image_shape, n)
    values = codec.encode(indices, images, labels)
    assert len(values) == -(-n // codec.records_per_message)
    assert all(isinstance(v, bytes) for v in values)
    batch = codec.decode(values)
    assert batch.indices.dtype == np.int64 and batch.labels.dtype == np.int64
    np.testing.assert_array_equal(batch.indices, indices)
    np.testing.assert_array_equal(batch.labels, labels)
    assert batch.pixels.shape == (n, *codec.image_shape)
    if codec.layout == "bytes":
        assert batch.pixels.dtype == np.uint8
        np.testing.assert_array_equal(batch.pixels, images)
    else:
        assert batch.pixels.dtype == np.float32
        np.testing.assert_allclose(batch.pixels, images.astype(np.float32) / 255, rtol=0, atol=1e-7)
    single = codec.decode(values[-1:])  # one value alone, as the reader decodes when localising errors
    np.testing.assert_array_equal(single.indices, indices[(len(values) - 1) * codec.records_per_message :])


def assert_refused(codec: Codec, good: list[bytes], bad: bytes, match: str | None = None) -> None:
    """The damaged value is refused alone and among good values, and the error names its position."""
    with pytest.raises((CorruptRecordError, ValueError), match=match):
        codec.decode([bad])
    with pytest.raises(CorruptRecordError, match=f"value {len(good)} of {len(good) + 1}"):
        codec.decode([*good, bad])


class CodecContract:
    """Behaviour every codec shares; subclasses name the format and what it supports."""

    format: str
    layouts: tuple[str, ...] = ("list", "bytes")
    rpms: tuple[int, ...] = (1, 4)

    def codecs(self) -> list[Codec]:
        return [
            get_codec(self.format, layout, shape, rpm, num_classes=10)
            for layout in self.layouts
            for shape in SHAPES
            for rpm in self.rpms
        ]

    def test_round_trips(self) -> None:
        for codec in self.codecs():
            check_round_trip(codec)

    def test_every_truncation_is_refused(self) -> None:
        for codec in self.codecs():
            indices, images, labels = samples(codec.image_shape, codec.records_per_message)
            value = codec.encode(indices, images, labels)[0]
            for cut in range(0, len(value), max(1, len(value) // 97)):
                with pytest.raises(CorruptRecordError):
                    codec.decode([value[:cut]])

    def test_trailing_garbage_and_empty_values_are_refused(self) -> None:
        for codec in self.codecs():
            good = codec.encode(*samples(codec.image_shape, 2 * codec.records_per_message))
            assert_refused(codec, good, good[0] + b"\x00")
            assert_refused(codec, good, b"")

    def test_a_damaged_value_among_good_ones_is_named(self) -> None:
        # Batched parses (one call over all values) must not blur value boundaries: a value split in two, or
        # a truncated or padded value between good ones, is refused and named by its own position.
        for codec in self.codecs():
            good = codec.encode(*samples(codec.image_shape, 3 * codec.records_per_message))
            middle = good[1]
            for damaged in (
                [middle[: len(middle) // 2], middle[len(middle) // 2 :]],
                [middle[:-1]],
                [middle + b"\x00"],
                [middle + good[2]],
                [b""],
            ):
                with pytest.raises(CorruptRecordError, match=f"value 1 of {len(damaged) + 2}"):
                    codec.decode([good[0], *damaged, good[2]])

    def test_label_out_of_range_is_refused_on_decode(self) -> None:
        for codec in self.codecs():
            lenient = get_codec(self.format, codec.layout, codec.image_shape, codec.records_per_message)
            indices, images, labels = samples(codec.image_shape, codec.records_per_message)
            labels[-1] = 12
            (value,) = lenient.encode(indices, images, labels)
            assert_refused(codec, [], value, match="label 12")
            lenient.decode([value])

    def test_other_image_shape_is_refused(self) -> None:
        for codec in self.codecs():
            for other_shape in (
                (1, 28, 28) if codec.image_shape != (1, 28, 28) else (3, 32, 32),
                codec.image_shape[::-1],
            ):  # same pixel count, other shape: caught by shape alone
                other = get_codec(self.format, codec.layout, other_shape, codec.records_per_message)
                # mongodb_avro's fingerprint covers the shape, so it refuses these before reading the record
                with pytest.raises(CorruptRecordError, match="shape|schema_fingerprint"):
                    codec.decode(other.encode(*samples(other_shape, 2)))

    def test_fingerprint_is_stable_and_names_the_contract(self) -> None:
        prints = {}
        for codec in self.codecs():
            fp = codec.schema_fingerprint()
            assert len(fp) == 64 and int(fp, 16) >= 0
            again = get_codec(self.format, codec.layout, codec.image_shape, codec.records_per_message)
            assert again.schema_fingerprint() == fp
            prints[codec.name, codec.image_shape] = fp
        assert len(set(prints.values())) == len(prints)

    def test_encode_checks_its_inputs(self) -> None:
        codec = get_codec(self.format, self.layouts[0], (1, 28, 28), num_classes=10)
        indices, images, labels = samples((1, 28, 28), 3)
        with pytest.raises(ValueError, match="uint8"):
            codec.encode(indices, images.astype(np.float32), labels)
        with pytest.raises(ValueError, match="shape"):
            codec.encode(indices, images[:, :, :27], labels)
        with pytest.raises(ValueError, match="one index and one label"):
            codec.encode(indices[:2], images, labels)
        with pytest.raises(ValueError, match="label 10"):
            codec.encode(indices, images, np.array([0, 10, 1]))
        with pytest.raises(ValueError, match="negative"):
            codec.encode(np.array([0, -1, 2]), images, labels)

    def test_empty_input(self) -> None:
        codec = get_codec(self.format, self.layouts[0], (1, 28, 28))
        assert codec.encode(*samples((1, 28, 28), 0)) == []
        assert codec.decode([]).pixels.shape == (0, 1, 28, 28)


class TestJson(CodecContract):
    format = "json"

    def test_the_original_consumer_reads_data_and_label(self) -> None:
        codec = get_codec("json", "list", (1, 28, 28))
        indices, images, labels = samples((1, 28, 28), 1)
        doc = json.loads(codec.encode(indices, images, labels)[0])
        assert set(doc) == {"data", "label", "index", "shape"}
        assert len(doc["data"]) == 784 and doc["label"] == labels[0] and doc["shape"] == [1, 28, 28]
        np.testing.assert_allclose(np.float32(doc["data"]), images[0].ravel() / 255, atol=1e-7)

    def test_bytes_layout_is_base64(self) -> None:
        codec = get_codec("json", "bytes", (1, 28, 28))
        indices, images, labels = samples((1, 28, 28), 1)
        doc = orjson.loads(codec.encode(indices, images, labels)[0])
        assert base64.b64decode(doc["data"]) == images[0].tobytes()

    @pytest.mark.parametrize(
        "mutate, match",
        [
            (lambda d: d.pop("label"), "missing field 'label'"),
            (lambda d: d.update(label="3"), "'label' must be an integer"),
            (lambda d: d.update(label=3.0), "'label' must be an integer"),
            (lambda d: d.update(index=True), "'index' must be an integer"),
            (lambda d: d.update(shape=[28, 28]), "shape"),
            (lambda d: d.update(data=d["data"][:-1]), "783 pixel values"),
            (lambda d: d.update(data=[2.0] * 784), r"outside \[0, 1\]"),
            (lambda d: d.update(data="AAAA"), "list of floats"),
        ],
    )
    def test_wrong_fields_are_refused(self, mutate, match) -> None:
        codec = get_codec("json", "list", (1, 28, 28))
        doc = orjson.loads(codec.encode(*samples((1, 28, 28), 1))[0])
        mutate(doc)
        assert_refused(codec, [], orjson.dumps(doc), match=match)

    def test_invalid_base64_is_refused(self) -> None:
        codec = get_codec("json", "bytes", (1, 28, 28))
        doc = orjson.loads(codec.encode(*samples((1, 28, 28), 1))[0])
        doc["data"] = "!" + doc["data"][1:]
        assert_refused(codec, [], orjson.dumps(doc))

    def test_a_batch_value_must_be_an_array(self) -> None:
        single = get_codec("json", "list", (1, 28, 28)).encode(*samples((1, 28, 28), 1))[0]
        assert_refused(get_codec("json", "list", (1, 28, 28), 4), [], single, match="JSON array")


class TestAvro(CodecContract):
    format = "avro"

    def test_writer_schema_is_mnistimage_v2(self) -> None:
        schema, _ = load_avro_schema("Meta", "MNISTImage")
        fields = {f["name"]: f["type"] for f in schema["fields"]}
        assert fields["data"] == {"type": "array", "items": "float"}
        assert fields["shape"] == {"type": "array", "items": "int"} and fields["label"] == "int"
        assert fields["meta"] == "Meta"
        meta = schema["__named_schemas"]["Meta"]
        assert [(f["name"], f["type"]) for f in meta["fields"]] == [
            ("index", "int"),
            ("partition", "int"),
            ("timestamp", "long"),
            ("format", "string"),
            ("compression", "string"),
        ]

    def test_values_are_schemaless_records_a_plain_reader_decodes(self) -> None:
        codec = get_codec("avro", "list", (1, 28, 28))
        indices, images, labels = samples((1, 28, 28), 1)
        value = codec.encode(indices, images, labels)[0]
        assert not value.startswith(b"Obj\x01") and value[:1] != b"\x00"  # no container header, no magic byte
        schema = json.loads((ROOT / "kbit_core/formats/schemas/MNISTImage.avsc").read_text())
        meta = json.loads((ROOT / "kbit_core/formats/schemas/Meta.avsc").read_text())
        named: dict = {}
        fastavro.parse_schema(meta, named_schemas=named)
        record = fastavro.schemaless_reader(io.BytesIO(value), fastavro.parse_schema(schema, named_schemas=named), None)
        assert record["label"] == labels[0] and record["meta"]["index"] == indices[0]
        assert record["meta"]["format"] == "avro"

    def test_index_beyond_avro_int_is_refused_on_encode(self) -> None:
        codec = get_codec("avro", "bytes", (1, 28, 28))
        _, images, labels = samples((1, 28, 28), 1)
        with pytest.raises(ValueError, match="Avro int"):
            codec.encode(np.array([2**31]), images, labels)


class TestProtobuf(CodecContract):
    format = "protobuf"

    def test_values_are_kbit_sample_messages(self) -> None:
        indices, images, labels = samples((1, 28, 28), 1)
        as_bytes = kbit_pb2.Sample.FromString(
            get_codec("protobuf", "bytes", (1, 28, 28)).encode(indices, images, labels)[0]
        )
        assert as_bytes.pixels == images[0].tobytes() and not as_bytes.data
        assert (as_bytes.index, as_bytes.label, list(as_bytes.shape)) == (indices[0], labels[0], [1, 28, 28])
        as_list = kbit_pb2.Sample.FromString(
            get_codec("protobuf", "list", (1, 28, 28)).encode(indices, images, labels)[0]
        )
        assert len(as_list.data) == 784 and not as_list.pixels

    def test_batch_cut_between_samples_is_refused(self) -> None:
        codec = get_codec("protobuf", "bytes", (1, 28, 28), 4)
        value = codec.encode(*samples((1, 28, 28), 4))[0]
        batch = kbit_pb2.SampleBatch.FromString(value)
        del batch.samples[3]
        assert_refused(codec, [], batch.SerializeToString(), match="count field says 4")

    @pytest.mark.skipif(
        importlib.util.find_spec("grpc_tools") is None,
        reason="grpcio-tools is not installed, so kbit_pb2.py cannot be regenerated here",
    )
    def test_committed_kbit_pb2_matches_a_fresh_generation(self, tmp_path: Path) -> None:
        subprocess.run(
            [str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        committed = (ROOT / "kbit_core/formats/schemas/kbit_pb2.py").read_text()
        assert (tmp_path / "kbit_pb2.py").read_text() == committed, "run scripts/gen_proto.sh and commit the result"


class TestBson(CodecContract):
    format = "bson"

    def test_values_are_bson_documents(self) -> None:
        indices, images, labels = samples((1, 28, 28), 1)
        doc = bson.decode(get_codec("bson", "bytes", (1, 28, 28)).encode(indices, images, labels)[0])
        assert doc == {"index": indices[0], "label": labels[0], "data": images[0].tobytes(), "shape": [1, 28, 28]}

    def test_wrong_field_types_are_refused(self) -> None:
        codec = get_codec("bson", "bytes", (1, 28, 28))
        doc = bson.decode(codec.encode(*samples((1, 28, 28), 1))[0])
        assert_refused(codec, [], bson.encode({**doc, "data": list(doc["data"])}), match="must be binary")
        assert_refused(codec, [], bson.encode({**doc, "label": 1.5}), match="'label' must be an integer")
        assert_refused(codec, [], bson.encode({k: v for k, v in doc.items() if k != "index"}), match="'index'")


class TestMongoDBAvro(CodecContract):
    format = "mongodb_avro"
    rpms = (1,)

    def test_document_is_the_original_export_envelope(self) -> None:
        codec = get_codec("mongodb_avro", "list", (1, 28, 28))
        indices, images, labels = samples((1, 28, 28), 1)
        doc = orjson.loads(codec.encode(indices, images, labels)[0])
        assert doc["_source"] == "mongodb" and doc["binary_data"]["Subtype"] == 0
        assert doc["schema_fingerprint"] == codec.schema_fingerprint()
        schema, _ = load_avro_schema("ImageMetadata", "MongoMNISTImage")
        record = fastavro.schemaless_reader(io.BytesIO(base64.b64decode(doc["binary_data"]["Data"])), schema, None)
        assert record["meta"] == {"dataset": "", "split": "", "index": indices[0]} and record["label"] == labels[0]

    def test_fingerprint_mismatch_is_refused(self) -> None:
        codec = get_codec("mongodb_avro", "bytes", (1, 28, 28))
        doc = orjson.loads(codec.encode(*samples((1, 28, 28), 1))[0])
        doc["schema_fingerprint"] = "0" * 64
        assert_refused(codec, [], orjson.dumps(doc), match="schema_fingerprint")
        del doc["schema_fingerprint"]
        assert_refused(codec, [], orjson.dumps(doc), match="missing field 'schema_fingerprint'")

    def test_several_records_per_message_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="at most 1"):
            get_codec("mongodb_avro", "list", (1, 28, 28), 4)


class TestRaw(CodecContract):
    format = "raw"
    layouts = ("bytes",)

    def test_list_layout_explains_why_not(self) -> None:
        assert not supported("raw", "list")
        with pytest.raises(ConfigError, match="speed baseline"):
            get_codec("raw", "list", (1, 28, 28))

    def test_layout_is_header_then_fixed_records(self) -> None:
        indices, images, labels = samples((1, 28, 28), 1)
        value = get_codec("raw", "bytes", (1, 28, 28)).encode(indices, images, labels)[0]
        assert value[:2] == b"KB" and len(value) == 14 + 10 + 784
        assert int.from_bytes(value[14:22], "little") == indices[0] and value[24:] == images[0].tobytes()

    def test_bad_magic_is_refused_in_the_vectorised_path(self) -> None:
        codec = get_codec("raw", "bytes", (1, 28, 28))
        good = codec.encode(*samples((1, 28, 28), 3))
        assert_refused(codec, good, b"XX" + good[0][2:], match="bad magic")

    def test_short_last_group_decodes(self) -> None:
        check_round_trip(get_codec("raw", "bytes", (1, 28, 28), 4), n=10)


def test_registry_lists_every_format() -> None:
    assert set(codec_names()) == {"json", "avro", "protobuf", "bson", "mongodb_avro", "raw"}
    assert all(supported(f, "bytes") for f in codec_names())
    assert not supported("xml", "list") and not supported("json", "floats")
    with pytest.raises(ConfigError, match="unknown format 'xml'"):
        get_codec("xml", "list", (1, 28, 28))
    with pytest.raises(ConfigError, match="unknown pixel layout"):
        get_codec("json", "floats", (1, 28, 28))
    with pytest.raises(ConfigError, match="one to three positive sizes"):
        get_codec("json", "list", (1, 1, 28, 28))
    with pytest.raises(ConfigError, match="one to three positive sizes"):
        get_codec("raw", "bytes", (0, 28))


@pytest.mark.parametrize("fmt", [f for f in codec_names() if supported(f, "list") and supported(f, "bytes")])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_of_the_other_layout_are_refused(fmt: str, shape: tuple[int, int, int]) -> None:
    as_list, as_bytes = get_codec(fmt, "list", shape), get_codec(fmt, "bytes", shape)
    data = samples(shape, 2)
    with pytest.raises(CorruptRecordError):
        as_list.decode(as_bytes.encode(*data))
    with pytest.raises(CorruptRecordError):
        as_bytes.decode(as_list.encode(*data))


def test_fingerprints_differ_across_formats() -> None:
    prints = [
        get_codec(f, layout, (1, 28, 28)).schema_fingerprint()
        for f in codec_names()
        for layout in ("list", "bytes")
        if supported(f, layout)
    ]
    assert len(set(prints)) == len(prints)


def test_decode_rates_reports_every_codec_against_raw() -> None:
    result = decode_rates((1, 8, 8), n=200, repeats=1)
    json.dumps(result)
    assert result["codecs"]["raw/bytes"]["decode_ratio_to_baseline"] == 1.0
    assert {"protobuf/bytes", "json/list", "mongodb_avro/bytes"} <= set(result["codecs"])
    assert all(row["decode_rps"] > 0 and row["bytes_per_record"] > 64 for row in result["codecs"].values())

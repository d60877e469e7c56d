"""Fast decoders: the codec contract holds for them, and they equal the stock decoders bit for bit, on good
records (NaN, inf, denormals, every shape, label and grouping) and on damaged ones (same error, same position)."""

from __future__ import annotations

import base64
import logging
import re
from unittest.mock import patch

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats import Codec, get_codec
from kbit_core.formats.fast import FastPath, select_codec, stock_reason
from kbit_core.formats.fast import base as fast_base
from kbit_core.formats.fast.avro import AvroWalker, FastAvroCodec, compile_plan
from kbit_core.formats.fast.base import Defer, UnsupportedSchema
from kbit_core.formats.microbench import fast_speedups
from tests.unit.test_formats import SHAPES, CodecContract

FAST = [
    ("avro", "list"),
    ("avro", "bytes"),
    ("mongodb_avro", "list"),
    ("mongodb_avro", "bytes"),
    ("json", "list"),
    ("json", "bytes"),
    ("protobuf", "list"),
    ("protobuf", "bytes"),
    ("bson", "list"),
    ("bson", "bytes"),
]


class FastContract(CodecContract):
    def codecs(self) -> list[Codec]:
        out = [
            get_codec(self.format, layout, shape, rpm, num_classes=10, decoder="fast")
            for layout in self.layouts
            for shape in SHAPES
            for rpm in self.rpms
        ]
        assert any(isinstance(c, FastPath) for c in out)
        return out


class TestFastAvro(FastContract):
    format = "avro"


class TestFastMongoDBAvro(FastContract):
    format = "mongodb_avro"
    rpms = (1,)


class TestFastJson(FastContract):
    format = "json"


class TestFastProtobuf(FastContract):
    format = "protobuf"


class TestFastBson(FastContract):
    format = "bson"


def outcome(codec: Codec, values: list[bytes]) -> tuple[str, ...] | tuple[np.ndarray, ...]:
    """What decoding gives: the arrays (pixels as raw bits), or the error's type and message."""
    try:
        batch = codec.decode(values)
    except CorruptRecordError as exc:
        return ("error", re.sub(r"0x[0-9a-f]+", "0x...", str(exc)))  # library messages may name object addresses
    return (
        batch.indices,
        batch.labels,
        batch.pixels.view(f"u{batch.pixels.itemsize}"),
        np.array(batch.pixels.shape),
        np.array([batch.pixels.dtype.str]),
    )


def assert_same(stock: Codec, fast: Codec, values: list[bytes]) -> None:
    expected, got = outcome(stock, values), outcome(fast, values)
    assert type(fast) is not type(stock) and isinstance(fast, FastPath)
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        if isinstance(e, str):
            assert e == g
        else:
            np.testing.assert_array_equal(e, g)


# float32 bit patterns: zeros of both signs, denormals, the pixel range, NaN/inf and any other pattern
SPECIAL_FLOATS = [
    0.0,
    -0.0,
    1.0,
    1 / 255,
    254 / 255,
    1.4e-45,
    1.1754942e-38,
    1.1754944e-38,
    5e-39,
    float("nan"),
    float("inf"),
    -float("inf"),
    -1e-45,
    1.0000001,
    0.99999994,
]
floats = st.one_of(
    st.sampled_from(SPECIAL_FLOATS),
    st.floats(0, 1, width=32),
    st.integers(0, 2**32 - 1).map(lambda bits: float(np.uint32(bits).view(np.float32))),
)


@st.composite
def records(draw: st.DrawFn, fmt: str, layout: str, blocks: bool = False) -> tuple[Codec, Codec, list[bytes]]:
    """Stock and fast codec of a drawn shape and grouping, and values they wrote. ``blocks``: as many values as
    a reader block holds at least, one record each, of consecutive indices (values of one length, so the
    column-wise paths run), labels 0..12."""
    shape = draw(st.sampled_from([(1, 2, 2), (1, 28, 28), (3, 4, 5), (2, 1, 3)]))
    rpm = 1 if fmt == "mongodb_avro" or blocks else draw(st.sampled_from([1, 2, 3, 8]))
    n = draw(st.integers(16, 40) if blocks else st.integers(1, 12))
    num_classes = draw(st.sampled_from([None, 10]))
    stock = get_codec(fmt, layout, shape, rpm, num_classes=num_classes)
    fast = get_codec(fmt, layout, shape, rpm, num_classes=num_classes, decoder="fast")
    size = int(np.prod(shape))
    if blocks:  # consecutive indices, from around where an index varint grows by a byte (64, 8192, ...)
        start = draw(st.sampled_from([0, 40, 8170, 1_048_560, 2**31 - 1 - 2 * n]))
        indices = start + draw(st.sampled_from([1, 2])) * np.arange(n, dtype=np.int64)
    else:
        indices = np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype=np.int64)
    labels = np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)), dtype=np.int64)
    # pixels from a drawn seed (shapes up to 28×28 are too large for element-wise drawing), then up to a dozen
    # drawn values at drawn positions: special floats, or any uint8 for the bytes layout
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if layout == "bytes":
        pixels = rng.integers(0, 256, n * size, dtype=np.uint8)
    else:
        pixels = rng.integers(0, 256, n * size).astype(np.float32) / np.float32(255)
    for at in draw(st.lists(st.integers(0, n * size - 1), max_size=12)):
        pixels[at] = draw(st.integers(0, 255) if layout == "bytes" else floats)
    # _encode takes pixels as they are: out-of-range and non-finite floats reach the encoded value too
    values = stock._encode(indices, labels, pixels.reshape(n, size))
    return stock, fast, values


def damage(data: st.DataObject, values: list[bytes]) -> None:
    """Flip, insert or delete a byte of a drawn value, or cut it short, in place."""
    target = data.draw(st.integers(0, len(values) - 1))
    value = bytearray(values[target])
    kind = data.draw(st.sampled_from(["flip", "cut", "insert", "drop"]))
    at = data.draw(st.integers(0, max(0, len(value) - 1)))
    if kind == "flip" and value:
        value[at] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del value[at:]
    elif kind == "insert":
        value[at:at] = data.draw(st.binary(min_size=1, max_size=9))
    elif value:
        del value[at]
    values[target] = bytes(value)


@pytest.mark.parametrize("damaged", [False, True], ids=["written", "damaged"])
@pytest.mark.parametrize("blocks", [False, True], ids=["groups", "blocks"])
@pytest.mark.parametrize(("fmt", "layout"), FAST)
@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fast_equals_stock(fmt: str, layout: str, blocks: bool, damaged: bool, data: st.DataObject) -> None:
    stock, fast, values = data.draw(records(fmt, layout, blocks))
    if damaged:
        damage(data, values)
    assert_same(stock, fast, values)


def test_blocks_of_equal_values_take_the_column_paths() -> None:
    # The template paths (BSON always, Avro for blocks of equal-length values) must really run, not defer.
    indices = np.arange(70_000, 70_064)
    images = np.random.default_rng(0).integers(0, 256, (64, 1, 28, 28), dtype=np.uint8)
    for fmt, layout in [("avro", "list"), ("avro", "bytes"), ("mongodb_avro", "bytes"), ("bson", "list")]:
        stock = get_codec(fmt, layout, (1, 28, 28))
        fast = get_codec(fmt, layout, (1, 28, 28), decoder="fast")
        values = stock.encode(indices, images, indices % 10)
        assert len(set(map(len, values))) == 1
        assert_same(stock, fast, values)
        assert fast.deferred_batches == 0
        if fmt != "bson":  # the Avro walker reads such a block as one matrix, not value by value
            payloads = [fast._avro_payload(v) for v in values] if fmt == "mongodb_avro" else values
            rows = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(payloads), -1)
            np.testing.assert_array_equal(fast._walker.by_template(rows)[0], indices)


@pytest.mark.parametrize("rpm", [1, 3])
def test_json_and_protobuf_bytes_blocks_take_the_template_path(rpm: int) -> None:
    # Indices across a digit and a varint width (9,999 -> 10,000; 16,383 -> 16,384), labels 0 (which protobuf
    # leaves out) to 12 (two digits): values of several lengths and layouts in one batch, none deferred.
    indices = np.concatenate([np.arange(9_990, 10_010), np.arange(16_370, 16_400)])
    images = np.random.default_rng(0).integers(0, 256, (len(indices), 1, 28, 28), dtype=np.uint8)
    for fmt in ("json", "protobuf"):
        stock = get_codec(fmt, "bytes", (1, 28, 28), rpm)
        fast = get_codec(fmt, "bytes", (1, 28, 28), rpm, decoder="fast")
        values = stock.encode(indices, images, indices % 13)
        assert len(set(map(len, values))) >= 3
        assert_same(stock, fast, values)
        assert fast.deferred_batches == 0
        np.testing.assert_array_equal(fast.decode(values).pixels, images)


def test_fast_speedups_compares_every_fast_decoder_with_its_stock_codec() -> None:
    result = fast_speedups((1, 4, 4), n=64, repeats=1, groupings=(1,))
    assert {(r["codec"], r["records_per_message"]) for r in result["rows"]} == {
        (f"{f}/{layout}", 1) for f, layout in FAST
    }
    assert all(r["stock_us"] > 0 and r["fast_us"] > 0 and r["speedup"] > 0 for r in result["rows"])


def test_a_bad_value_is_named_like_the_stock_decoder_names_it() -> None:
    for fmt, layout in FAST:
        stock = get_codec(fmt, layout, (1, 4, 4), num_classes=10)
        fast = get_codec(fmt, layout, (1, 4, 4), num_classes=10, decoder="fast")
        good = stock.encode(np.arange(3), np.zeros((3, 1, 4, 4), np.uint8), np.arange(3))
        bad = stock.encode(np.arange(1), np.zeros((1, 1, 4, 4), np.uint8), np.array([1]))[0][:-3]
        with pytest.raises(CorruptRecordError, match="value 2 of 4") as err:
            fast.decode([good[0], good[1], bad, good[2]])
        assert outcome(stock, [good[0], good[1], bad, good[2]]) == ("error", str(err.value))


def test_only_formats_without_a_fast_decoder_stay_stock(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kbit_core.formats.fast"):
        codec = get_codec("raw", "bytes", (1, 28, 28), decoder="fast")
    assert not isinstance(codec, FastPath)
    assert stock_reason("raw", "bytes") in caplog.text
    for fmt, layout in FAST:
        assert isinstance(get_codec(fmt, layout, (1, 28, 28), decoder="fast"), FastPath)
        assert stock_reason(fmt, layout) is None
    assert not isinstance(get_codec("avro", "list", (1, 28, 28), decoder="stock"), FastPath)
    with pytest.raises(ConfigError, match="unknown decoder"):
        get_codec("avro", "list", (1, 28, 28), decoder="turbo")


def test_a_schema_the_fast_path_does_not_know_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stock = get_codec("avro", "list", (1, 28, 28))
    union = {"type": "record", "name": "X", "fields": [{"name": "data", "type": ["null", "float"]}]}
    with pytest.raises(UnsupportedSchema, match="data"):
        compile_plan(union, "list")
    no_meta = {
        "type": "record",
        "name": "X",
        "fields": [
            {"name": "data", "type": {"type": "array", "items": "float"}},
            {"name": "shape", "type": {"type": "array", "items": "int"}},
            {"name": "label", "type": "int"},
        ],
    }
    with pytest.raises(UnsupportedSchema, match="index"):
        compile_plan(no_meta, "list")

    def refuse(self: FastAvroCodec, *args: object, **kwargs: object) -> None:
        raise UnsupportedSchema("a field the walker does not know")

    monkeypatch.setattr(FastAvroCodec, "__init__", refuse)
    with caplog.at_level(logging.WARNING, logger="kbit_core.formats.fast"):
        assert select_codec(stock, "fast") is stock
    assert "does not recognise its schema (a field the walker does not know)" in caplog.text


def test_unusual_but_valid_avro_blocks_decode_like_fastavro() -> None:
    # Avro writers may split arrays into blocks, with a negative count followed by the block's byte size.
    import io

    import fastavro

    stock = get_codec("avro", "list", (1, 2, 2))
    fast = get_codec("avro", "list", (1, 2, 2), decoder="fast")
    record = {
        "data": [0.0, 0.25, 0.5, 1.0],
        "shape": [1, 2, 2],
        "label": 3,
        "meta": {"index": 7, "partition": 0, "timestamp": 0, "format": "avro", "compression": ""},
    }
    out = io.BytesIO()
    fastavro.schemaless_writer(out, stock._schema, record)
    plain = out.getvalue()
    head = plain.index(bytes([8]))  # block count 4, zigzag
    floats = plain[head + 1 : head + 17]
    blocked = plain[:head] + bytes([3, 16]) + floats[:8] + bytes([3, 16]) + floats[8:] + plain[head + 17 :]
    assert blocked != plain
    assert_same(stock, fast, [plain, blocked])
    np.testing.assert_array_equal(fast.decode([blocked]).pixels.reshape(-1), record["data"])
    assert fast.deferred_batches == 0


# ---- Avro and mongodb_avro blocks: several value lengths, read as byte matrices ----------------------------------

AVRO_FAST = [("avro", "bytes"), ("avro", "list"), ("mongodb_avro", "bytes"), ("mongodb_avro", "list")]


@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize(("fmt", "layout"), AVRO_FAST)
def test_avro_blocks_of_several_lengths_are_read_as_matrices(
    fmt: str, layout: str, shuffled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every other index across the varint widths at 8,192 and 1,048,576 (three payload lengths), in order or not,
    # in parts of at most 40 values: each part's payloads of one length are read as a matrix by template, and only
    # the first value of each length is walked.
    indices = np.concatenate([np.arange(8_100, 8_300, 2), np.arange(1_048_500, 1_048_700, 2)])
    if shuffled:
        indices = np.random.default_rng(1).permutation(indices)
    images = np.random.default_rng(0).integers(0, 256, (len(indices), 1, 28, 28), dtype=np.uint8)
    stock = get_codec(fmt, layout, (1, 28, 28), num_classes=10)
    fast = get_codec(fmt, layout, (1, 28, 28), num_classes=10, decoder="fast")
    values = stock.encode(indices, images, indices % 10)
    payloads = [fast._avro_payload(v) for v in values] if fmt == "mongodb_avro" else values
    assert len(set(map(len, payloads))) == 3  # (mongodb_avro: in envelopes of one length, padded differently)
    walked: list[int] = []
    matrices: list[int] = []
    walk, by_template = AvroWalker._walked, AvroWalker.by_template
    monkeypatch.setattr(AvroWalker, "_walked", lambda self, vs: walked.append(len(vs)) or walk(self, vs))
    monkeypatch.setattr(
        AvroWalker, "by_template", lambda self, rows: matrices.append(len(rows)) or by_template(self, rows)
    )
    monkeypatch.setattr(fast_base, "GROUP_BYTES", 40 * max(map(len, values)))
    assert_same(stock, fast, values)
    assert fast.deferred_batches == 0
    assert sum(matrices) == len(values) and max(matrices) <= 40
    assert walked == [1, 1, 1]  # one value per payload length: later matrices of that length reuse its template
    np.testing.assert_array_equal(fast.decode(values).indices, indices)


@st.composite
def avro_blocks(draw: st.DrawFn, fmt: str, layout: str) -> tuple[Codec, Codec, list[bytes]]:
    """A block as a partition delivers one, or shuffled: index runs from around where a varint grows (64, 8,192,
    1,048,576, 134,217,728, the int's end), labels up to 199 (two-byte varints: values of one length whose index
    and label widths differ)."""
    shape = draw(st.sampled_from([(1, 2, 2), (3, 4, 5), (1, 28, 28)]))
    num_classes = draw(st.sampled_from([None, 10, 200]))
    n = draw(st.integers(16, 100))
    start = draw(st.sampled_from([0, 30, 8_150, 1_048_540, 134_217_700, 2**31 - 1 - 3 * n]))
    indices = start + draw(st.integers(1, 3)) * np.arange(n)
    if draw(st.booleans()):
        indices = np.array(draw(st.permutations(indices.tolist())))
    labels = np.array(draw(st.lists(st.integers(0, (num_classes or 200) - 1), min_size=n, max_size=n)))
    images = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (n, *shape), dtype=np.uint8)
    stock = get_codec(fmt, layout, shape, num_classes=num_classes)
    fast = get_codec(fmt, layout, shape, num_classes=num_classes, decoder="fast")
    return stock, fast, stock.encode(indices, images, labels)


def damage_envelope(data: st.DataObject, values: list[bytes]) -> None:
    """Edit a drawn export envelope's Data string in place: any byte at any position (another base64 letter gives
    other, maybe valid, Avro bytes), a JSON escape, no padding, a space after the key."""
    strings = {i: found.span(1) for i, v in enumerate(values) if (found := re.search(rb'"Data":"([^"]+)"', v))}
    if not strings:  # all garbage already
        return
    target = data.draw(st.sampled_from(sorted(strings)))
    value, (start, stop) = bytearray(values[target]), strings[target]
    kind = data.draw(st.sampled_from(["byte", "escape", "unpad", "space"]))
    if kind == "byte":
        value[data.draw(st.integers(start, stop - 1))] = data.draw(st.integers(0, 255))
    elif kind == "escape" and b"/" in value[start:stop]:
        at = value.index(b"/", start)
        value[at : at + 1] = b"\\/"
    elif kind == "unpad":
        value[start:stop] = value[start:stop].rstrip(b"=")
    elif kind == "space":
        value[start - 1 : start - 1] = b" "
    values[target] = bytes(value)


@pytest.mark.parametrize(("fmt", "layout"), AVRO_FAST)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_avro_blocks_decode_like_stock(fmt: str, layout: str, data: st.DataObject) -> None:
    stock, fast, values = data.draw(avro_blocks(fmt, layout))
    kinds = ["none", "value", "garbage"] + (["envelope"] if fmt == "mongodb_avro" else [])
    for kind in data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3)):
        if kind == "value":
            damage(data, values)
        elif kind == "garbage":  # as long as its neighbours, so it joins their matrix
            target = data.draw(st.integers(0, len(values) - 1))
            values[target] = data.draw(st.binary(min_size=len(values[target]), max_size=len(values[target])))
        elif kind == "envelope":
            damage_envelope(data, values)
    group = data.draw(st.sampled_from([None, 16, 40]))
    with patch.object(fast_base, "GROUP_BYTES", group * max(map(len, values)) if group else fast_base.GROUP_BYTES):
        assert_same(stock, fast, values)


@pytest.mark.parametrize("decoy", ["duplicate-key", "other-object", "escaped-key"])
def test_a_look_alike_data_string_is_not_taken_for_the_payload(decoy: str) -> None:
    # Every envelope carries binary_data.Data of the first one, and before it a second "Data":"..." of that length
    # (a duplicate key, which orjson overrides with the last; a field of another object; the tail of a key) that
    # differs from envelope to envelope, equal to it in the first. Only what orjson reads may be decoded.
    stock = get_codec("mongodb_avro", "bytes", (1, 4, 4))
    fast = get_codec("mongodb_avro", "bytes", (1, 4, 4), decoder="fast")
    images = np.random.default_rng(0).integers(0, 256, (32, 1, 4, 4), dtype=np.uint8)
    written = stock.encode(np.arange(100, 132), images, np.arange(32) % 10)
    strings = [v[v.index(b'"Data":"') + 8 : v.index(b'"', v.index(b'"Data":"') + 8)] for v in written]
    first, kept = written[0], b'"Data":"' + strings[0]
    old, new = {
        "duplicate-key": (kept, b'"Data":"%s",' + kept),
        "other-object": (b'{"binary_data"', b'{"other":{"Data":"%s"},"binary_data"'),
        "escaped-key": (b'{"binary_data"', b'{"x\\"Data":"%s","binary_data"'),
    }[decoy]
    values = [first.replace(old, new % s) for s in strings]
    assert len(set(map(len, values))) == 1
    np.testing.assert_array_equal(stock.decode(values).indices, np.full(32, 100))
    assert_same(stock, fast, values)


@pytest.mark.parametrize("fmt", ["avro", "mongodb_avro"])
@pytest.mark.parametrize("shape", [(1, 2, 2), (1, 1, 5), (1, 2, 3)], ids=["no-pad", "two-pads", "one-pad"])  # base64
def test_every_byte_of_a_block_value_is_judged_like_stock(fmt: str, shape: tuple[int, int, int]) -> None:
    # One value in a block of 16, each of its bytes (mongodb_avro: of its Data string) set to each byte value: the
    # matrix may read it only where the stock decoder reads the same record; else the same error.
    stock = get_codec(fmt, "bytes", shape, num_classes=10)
    fast = get_codec(fmt, "bytes", shape, num_classes=10, decoder="fast")
    images = np.random.default_rng(0).integers(0, 256, (16, *shape), dtype=np.uint8)
    values = stock.encode(np.arange(64, 80), images, np.arange(16) % 10)
    value = values[7]
    start = value.index(b'"Data":"') + 8 if fmt == "mongodb_avro" else 0
    stop = value.index(b'"', start) if fmt == "mongodb_avro" else len(value)
    for at in range(start, stop):
        for byte in range(256):
            assert_same(stock, fast, [*values[:7], value[:at] + bytes([byte]) + value[at + 1 :], *values[8:]])


@pytest.mark.parametrize("change", ["fingerprint", "subtype"])
def test_a_block_of_envelopes_from_another_writer_fails_like_stock(change: str) -> None:
    # Every envelope of the block carries the same wrong fingerprint or binary subtype: they agree with one another,
    # so only the check of the first one (the stock codec's) can refuse them, also after a good block of that
    # length was decoded (whose envelope the codec keeps as the template).
    stock = get_codec("mongodb_avro", "bytes", (1, 4, 4))
    fast = get_codec("mongodb_avro", "bytes", (1, 4, 4), decoder="fast")
    good = stock.encode(np.arange(32), np.zeros((32, 1, 4, 4), np.uint8), np.zeros(32, np.int64))
    assert_same(stock, fast, good)
    old, new = (
        (stock.schema_fingerprint().encode(), b"0" * 64)
        if change == "fingerprint"
        else (b'"Subtype":0', b'"Subtype":4')
    )
    values = [v.replace(old, new) for v in good]
    assert len(set(map(len, values + good))) == 1
    assert_same(stock, fast, values)
    with pytest.raises(CorruptRecordError, match="value 0 of 32"):
        fast.decode(values)


def test_a_letter_after_a_data_strings_padding_is_not_read_as_padding() -> None:
    # Strict base64 refuses "..x=A": replacing the padding by "A" must not turn it into a longer payload.
    stock = get_codec("mongodb_avro", "bytes", (1, 1, 5))
    fast = get_codec("mongodb_avro", "bytes", (1, 1, 5), decoder="fast")
    values = stock.encode(np.arange(64, 80), np.zeros((16, 1, 1, 5), np.uint8), np.zeros(16, np.int64))
    stop = values[3].index(b'"', values[3].index(b'"Data":"') + 8)
    assert values[3][stop - 2 : stop] == b"=="
    values[3] = values[3][: stop - 1] + b"A" + values[3][stop:]
    with pytest.raises(Defer, match="inside a Data string"):
        fast._payload_rows(values)
    assert_same(stock, fast, values)


# ---- the bytes-layout templates (protobuf, JSON): values written by other writers, or damaged ----------------


def varint(value: int, extra: int = 0) -> bytes:
    """Base-128 varint of ``value`` (two's complement in 64 bits when negative), padded with ``extra``
    continuation bytes: an overlong encoding parsers accept."""
    value &= 2**64 - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    if extra:
        out[-1] |= 0x80
        out += b"\x80" * (extra - 1) + b"\x00"
    return bytes(out)


@st.composite
def protobuf_field(draw: st.DrawFn, tag: int, others: bool) -> tuple[bytes, bool]:
    """A varint field as kbit's writer, or ``others`` (any writer, any int64) may write it, and whether the
    template reads it (at most 9 bytes)."""
    if others:
        value = draw(
            st.one_of(
                st.integers(0, 12),
                st.integers(0, 2**63 - 1),
                st.integers(-(2**63), 2**64 - 1),
                st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**35, 2**63 - 1]),
            )
        )
        encoded = varint(value, draw(st.sampled_from([0, 0, 0, 1, 2])))
    else:  # up to 8 bytes, maybe one overlong byte more: int32 labels past 2**31 keep their low 32 bits
        encoded = varint(draw(st.one_of(st.integers(0, 12), st.integers(0, 2**56 - 1))), draw(st.sampled_from([0, 1])))
    return bytes([tag]) + encoded, len(encoded) <= 9


@pytest.mark.parametrize("rpm", [1, 3])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_protobuf_bytes_headers_decode_like_upb(rpm: int, data: st.DataObject) -> None:
    # Index and label fields of every width (int64 up to 2**63 - 1 in 9 bytes, negative in 10), overlong,
    # left out, swapped or repeated; int32 labels keep the low 32 bits, as upb stores them. Half the batches
    # hold only values the template reads, of mixed lengths: none of them may go to upb.
    shape = data.draw(st.sampled_from([(1, 2, 2), (3, 4, 5), (1, 28, 28)]))
    stock = get_codec("protobuf", "bytes", shape, rpm)
    fast = get_codec("protobuf", "bytes", shape, rpm, decoder="fast")
    from kbit_core.formats.schemas import kbit_pb2

    others = data.draw(st.booleans())
    samples, readable = [], True
    for _ in range(data.draw(st.integers(1, 24))):
        fields = [data.draw(protobuf_field(tag, others)) for tag in (0x08, 0x10) if data.draw(st.booleans())]
        order = data.draw(st.sampled_from(["written", "swapped", "repeated"])) if others else "written"
        if order == "swapped":
            fields.reverse()
        elif order == "repeated" and fields:
            fields.append(data.draw(protobuf_field(0x08, others)))
        readable &= order == "written" or len(fields) < 2
        readable &= all(ok for _, ok in fields)
        pixels = np.random.default_rng(len(samples)).integers(0, 256, int(np.prod(shape)), dtype=np.uint8)
        tail = kbit_pb2.Sample(pixels=pixels.tobytes(), shape=shape).SerializeToString()
        samples.append(b"".join(field for field, _ in fields) + tail)
    values = samples if rpm == 1 else []
    while rpm > 1 and samples:
        # kbit writes 1..rpm samples, then their count; another writer may put the count first or leave it out
        take = data.draw(st.integers(1, rpm + others))
        group, samples = samples[:take], samples[take:]
        count = len(group) + (data.draw(st.sampled_from([0, 0, 0, 1, -1])) if others else 0)
        where = data.draw(st.sampled_from(["end", "end", "end", "start", "none"])) if others else "end"
        readable &= len(group) <= rpm and count == len(group) and where == "end"
        entries = b"".join(b"\x0a" + varint(len(s)) + s for s in group)
        count_field = b"\x10" + varint(count) if where != "none" else b""
        values.append(count_field + entries if where == "start" else entries + count_field)
    assert_same(stock, fast, values)
    assert readable or others
    if readable:
        assert fast.deferred_batches == 0


KBIT_NUMBERS = st.one_of(st.integers(0, 12), st.integers(0, 10**18 - 1)).map(str)  # 1..18 digits
JSON_NUMBERS = st.one_of(
    KBIT_NUMBERS,
    st.integers(0, 2**64).map(str),
    st.sampled_from(
        [
            "0",
            "00",
            "07",
            "-0",
            "-3",
            "+3",
            "1.0",
            "1e2",
            "3 ",
            " 3",
            "true",
            "null",
            '"3"',
            "",
            "1_0",
            "9" * 19,
            "1" + "0" * 25,
            "\\u0033",
        ]
    ),
)


@pytest.mark.parametrize("rpm", [1, 3])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_json_bytes_texts_decode_like_orjson(rpm: int, data: st.DataObject) -> None:
    # Numbers of every width with leading zeros, signs, exponents, whitespace, escapes; base64 strings with
    # a character of any byte value, JSON escapes (\/ is a valid "/"), other padding; other key orders. Half
    # the batches hold only kbit's text, of mixed lengths: none of them may go to orjson.
    shape = data.draw(st.sampled_from([(1, 2, 2), (1, 2, 3), (1, 1, 3), (3, 4, 5), (1, 28, 28)]))
    stock = get_codec("json", "bytes", shape, rpm)
    fast = get_codec("json", "bytes", shape, rpm, decoder="fast")
    size = int(np.prod(shape))
    others = data.draw(st.booleans())
    records, readable = [], True
    for _ in range(data.draw(st.integers(1, 24))):
        pixels = np.random.default_rng(len(records)).integers(0, 256, size, dtype=np.uint8).tobytes()
        text = bytearray(base64.b64encode(pixels))
        edit = data.draw(st.sampled_from(["none", "none", "byte", "escape", "cut", "text"])) if others else "none"
        at = data.draw(st.integers(0, len(text) - 1))
        if edit == "byte":
            text[at] = data.draw(st.integers(0, 255))
        elif edit == "escape" and b"/" in text:
            text[text.index(b"/") : text.index(b"/") + 1] = b"\\/"
        elif edit == "cut":
            del text[at]
        label, index = (data.draw(JSON_NUMBERS if others else KBIT_NUMBERS) for _ in range(2))
        numbers_ok = all(re.fullmatch(r"0|[1-9][0-9]{0,17}", n) for n in (label, index))
        readable &= numbers_ok and bytes(text) == base64.b64encode(pixels)
        fields = [
            b'"data":"' + bytes(text) + b'"',
            b'"label":' + label.encode(),
            b'"index":' + index.encode(),
            b'"shape":[' + ",".join(map(str, shape)).encode() + b"]",
        ]
        if others and data.draw(st.integers(0, 9)) == 0:
            fields.reverse()
            readable = False
        record = bytearray(b"{" + b",".join(fields) + b"}")
        if edit == "text":  # a byte of the text around the base64 string
            start = len(b'{"data":"')
            outside = [i for i in range(len(record)) if not start <= i < start + len(text)]
            record[data.draw(st.sampled_from(outside))] = data.draw(st.integers(0, 255))
            readable = False
        records.append(bytes(record))
    values = records if rpm == 1 else []
    while rpm > 1 and records:
        take = data.draw(st.integers(1, rpm + others))
        group, records = records[:take], records[take:]
        readable &= len(group) <= rpm
        values.append(b"[" + b",".join(group) + b"]")
    assert_same(stock, fast, values)
    assert readable or others
    if readable:
        assert fast.deferred_batches == 0


@pytest.mark.parametrize("field", ["label", "index"])
def test_json_numbers_only_orjson_reads_go_to_orjson(field: str) -> None:
    stock = get_codec("json", "bytes", (1, 2, 2))
    fast = get_codec("json", "bytes", (1, 2, 2), decoder="fast")
    good = stock.encode(np.arange(3), np.zeros((3, 1, 2, 2), np.uint8), np.array([1, 2, 3]))
    for number in [
        "00",
        "07",
        "-0",
        "-3",
        "+3",
        "1.0",
        "1e2",
        " 3",
        "3 ",
        "true",
        '"3"',
        "0x1",
        "9" * 19,
        "\\u0033",
        "123456789012345678",
    ]:
        value = re.sub(f'"{field}":[0-9]+,'.encode(), lambda _, number=number: f'"{field}":{number},'.encode(), good[1])
        assert value != good[1]
        assert_same(stock, fast, [good[0], value, good[2]])


def test_grouped_json_and_protobuf_bytes_unlike_kbit_s_go_to_the_library() -> None:
    # Grouped values the templates must not read: more samples than records_per_message, and (protobuf) a
    # count that disagrees, is left out or comes first.
    images = np.zeros((4, 1, 2, 2), np.uint8)
    for fmt in ("json", "protobuf"):
        stock = get_codec(fmt, "bytes", (1, 2, 2), 3)
        fast = get_codec(fmt, "bytes", (1, 2, 2), 3, decoder="fast")
        wide = get_codec(fmt, "bytes", (1, 2, 2), 4).encode(np.arange(4), images, np.arange(4))[0]
        good = stock.encode(np.arange(3), images[:3], np.arange(3))[0]
        unlike = [wide]
        if fmt == "protobuf":
            samples, count = good[:-2], good[-2:]
            assert count == b"\x10\x03"
            unlike += [samples + b"\x10\x02", samples, count + samples]
        for value in unlike:
            deferred = fast.deferred_batches
            assert_same(stock, fast, [good, value])
            assert fast.deferred_batches > deferred
        assert_same(stock, fast, [good, good])
        assert outcome(stock, [wide])[0] == "error"


@pytest.mark.parametrize("shape", [(1, 2, 2), (1, 1, 5), (1, 2, 3)], ids=["two-pads", "one-pad", "no-pad"])
def test_every_byte_in_a_base64_string_is_judged_like_binascii(shape: tuple[int, int, int]) -> None:
    stock = get_codec("json", "bytes", shape)
    fast = get_codec("json", "bytes", shape, decoder="fast")
    good = stock.encode(np.arange(2), np.full((2, *shape), 0xA5, np.uint8), np.arange(2))
    start = good[0].index(b'"data":"') + len(b'"data":"')
    width = len(base64.b64encode(bytes(int(np.prod(shape)))))
    for at in range(start, start + width):
        for byte in range(256):
            value = bytearray(good[0])
            value[at] = byte
            assert_same(stock, fast, [bytes(value), good[1]])


# ---- JSON lists (kbit's text by template, anything else through orjson) and BSON lists in parts -----------------

# Numbers orjson reads as doubles in [0, 1] (so the batch decodes), written as other writers may: integers, -0,
# exponents, 17 and more digits, subnormal doubles and doubles that round to float32 subnormals or to 0
IN_RANGE_NUMBERS = [
    "0",
    "1",
    "-0",
    "-0.0",
    "0.0",
    "1.0",
    "0.5e0",
    "5E-1",
    "1e+0",
    "1e-400",
    "5e-324",
    "1e-320",
    "2.2250738585072014e-308",
    "1.401298464324817e-45",
    "7.006492321624085e-46",
    "7.0064923216240854e-46",
    "1.1754942807573643e-38",
    "0.1000000000000000055511151231257827",
    "0.99999999999999999999",
    "0.333333333333333314829616256247390992939472198486328125",
]
# Numbers and texts orjson rejects, or reads as something the stock checks refuse
OTHER_NUMBERS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "01",
    "+1",
    ".5",
    "1.",
    "1e",
    "-",
    "0x1",
    "2.5",
    "-0.5",
    "1e400",
    "18446744073709551616",
    "[0.5]",
    "[]",
    "[[]]",
    "null",
    "true",
    '"0.5"',
    "{}",
    "0.5 ",
    " 0.5",
]
INTEGERS = [
    "0",
    "7",
    "12",
    "00",
    "07",
    "-0",
    "-3",
    "+3",
    "1.0",
    "1e2",
    " 3",
    "true",
    "null",
    '"3"',
    "9" * 19,
    str(2**63),
    str(10**18 - 1),
]


def float32_halfway(rng: np.random.Generator, count: int) -> list[str]:
    """17-digit doubles at and next to the midpoint of two neighbouring float32 values in [0, 1]: rounding them
    to float32 directly and through the double differ unless the double is exact."""
    low = rng.random(count).astype(np.float32)
    mid = (low.astype(np.float64) + np.nextafter(low, np.float32(2)).astype(np.float64)) / 2
    return [repr(float(x)) for x in np.nextafter(mid, mid + rng.choice([-1.0, 0.0, 1.0], count))]


@st.composite
def json_list_values(draw: st.DrawFn, other_writers: bool) -> tuple[Codec, Codec, list[bytes], bool]:
    """Stock and fast JSON list codecs and values written as kbit writes them but with numbers in any JSON
    spelling; with ``other_writers`` also with other numbers, key orders, whitespace, extra or repeated keys,
    other label and index texts, other groupings. The flag says whether every value is in kbit's text."""
    shape = draw(st.sampled_from([(1, 2, 2), (3, 4, 5), (1, 28, 28)]))
    rpm = draw(st.sampled_from([1, 2, 3]))
    stock = get_codec("json", "list", shape, rpm, num_classes=10)
    fast = get_codec("json", "list", shape, rpm, num_classes=10, decoder="fast")
    size = int(np.prod(shape))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    records, kbit_text = [], True
    for _ in range(draw(st.integers(1, 10))):
        pixels = rng.integers(0, 256, size).astype(np.float32) / np.float32(255)
        numbers = orjson.dumps(pixels, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")  # the encoder's
        spellings = [rng.random(size).astype(str), float32_halfway(rng, size)]
        for at, kind in draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 3)), max_size=size)):
            numbers[at] = (spellings[kind][at] if kind < 2 else draw(st.sampled_from(IN_RANGE_NUMBERS))).encode()
        fields = {
            "data": b"[" + b",".join(numbers) + b"]",
            "label": str(draw(st.integers(0, 9))).encode(),
            "index": str(draw(st.integers(0, 10**18 - 1))).encode(),
            "shape": b"[" + ",".join(map(str, shape)).encode() + b"]",
        }
        order = ["data", "label", "index", "shape"]
        edit = (
            draw(
                st.sampled_from(
                    ["none", "none", "number", "integer", "order", "space", "extra", "repeat", "shape", "comma"]
                )
            )
            if other_writers
            else "none"
        )
        if edit == "number":
            numbers[draw(st.integers(0, size - 1))] = draw(st.sampled_from(OTHER_NUMBERS)).encode()
            fields["data"] = b"[" + b",".join(numbers) + b"]"
        elif edit == "integer":
            fields[draw(st.sampled_from(["label", "index"]))] = draw(st.sampled_from(INTEGERS)).encode()
        elif edit == "order":
            order = draw(st.permutations(order))
        elif edit == "extra":
            order.insert(draw(st.integers(0, 4)), "extra")
            fields["extra"] = draw(st.sampled_from([b"[[1]]", b"[1,2]", b'"]"', b"{}"]))
        elif edit == "repeat":
            key = draw(st.sampled_from(order))
            order.insert(draw(st.integers(0, 4)), key)
        elif edit == "shape":
            fields["shape"] = b"[" + ",".join(map(str, shape[::-1])).encode() + b"," + b"1]"
        elif edit == "comma":
            fields["data"] = fields["data"][:-1] + b",]"
        record = b"{" + b",".join(b'"' + key.encode() + b'":' + fields[key] for key in order) + b"}"
        if edit == "space":
            at = draw(st.sampled_from([m.end() for m in re.finditer(rb"[:,\[{]", record)]))
            record = record[:at] + draw(st.sampled_from([b" ", b"\n", b"\t"])) + record[at:]
        kbit_text &= edit == "none" or (edit == "order" and order == ["data", "label", "index", "shape"])
        records.append(record)
    values = records if rpm == 1 else []
    while rpm > 1 and records:
        take = draw(st.integers(1, rpm + (1 if other_writers else 0)))
        group, records = records[:take], records[take:]
        kbit_text &= len(group) <= rpm
        values.append(b"[" + b",".join(group) + b"]")
    return stock, fast, values, kbit_text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_json_lists_in_kbits_text_decode_like_orjson_without_deferring(data: st.DataObject) -> None:
    stock, fast, values, kbit_text = data.draw(json_list_values(other_writers=False))
    assert kbit_text
    assert_same(stock, fast, values)
    assert fast.deferred_batches == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_json_lists_of_other_writers_decode_like_orjson(data: st.DataObject) -> None:
    stock, fast, values, kbit_text = data.draw(json_list_values(other_writers=True))
    if data.draw(st.booleans()):
        damage(data, values)
        kbit_text = False
    assert_same(stock, fast, values)
    if kbit_text:
        assert fast.deferred_batches == 0


@pytest.mark.parametrize("nested", [b"[0.5],0.25", b"[],[0.5,0.25]", b"[[0.5]],0.25"])
def test_a_json_list_with_a_nested_array_fails_like_orjson(nested: bytes) -> None:
    # as_buffer flattens nested arrays: these have C*H*W numbers when flattened, which must not pass as pixels
    stock = get_codec("json", "list", (1, 2, 2))
    fast = get_codec("json", "list", (1, 2, 2), decoder="fast")
    value = b'{"data":[' + nested + b',0.5,0.75],"label":1,"index":2,"shape":[1,2,2]}'
    with pytest.raises(CorruptRecordError, match="value 0 of 1"):
        stock.decode([value])
    assert_same(stock, fast, [value])


@pytest.mark.parametrize("rpm", [1, 3])
def test_json_and_bson_list_blocks_of_several_parts_decode_like_stock(rpm: int) -> None:
    # 399 records of 1x28x28: several GROUP_BYTES parts per block, every part's records in their own rows
    indices = np.arange(70_000, 70_399)
    images = np.random.default_rng(0).integers(0, 256, (len(indices), 1, 28, 28), dtype=np.uint8)
    for fmt in ("json", "bson"):
        stock = get_codec(fmt, "list", (1, 28, 28), rpm)
        fast = get_codec(fmt, "list", (1, 28, 28), rpm, decoder="fast")
        values = stock.encode(indices, images, indices % 10)
        assert sum(map(len, values)) > 3 * fast_base.GROUP_BYTES
        assert_same(stock, fast, values)
        assert fast.deferred_batches == 0
        batch = fast.decode(values)
        np.testing.assert_array_equal(batch.indices, indices)
        np.testing.assert_array_equal(batch.pixels, images.astype(np.float32) / np.float32(255))

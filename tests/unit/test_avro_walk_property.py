"""kbit's fast Avro decoder, built from a writer schema, decodes bit for bit what confluent-kafka's AvroDeserializer
decodes: a property test over generated schemas of every shape the fast path supports and generated records."""

from __future__ import annotations

import itertools
import json
import math
import struct
from typing import Any

import numpy as np
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kbit_core.formats.confluent.avro_decoder import AvroSchemaDecoder
from kbit_core.formats.confluent.avro_walk import flatten

# The mock client is confluent-kafka's in-process registry: this is a unit test of decoding, not of the registry
# (tests/integration/test_schema_registry.py runs the real one).
CLIENT = SchemaRegistryClient.new_client({"url": "mock://avro-walk-property"})
SUBJECTS = itertools.count()
FAST_LONG = 2**62  # longs of up to 9 varint bytes take the fast path; longer ones defer to fastavro

SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "boolean": st.booleans(),
    "int": st.integers(-(2**31), 2**31 - 1),
    "long": st.integers(-FAST_LONG, FAST_LONG - 1),
    "float": st.floats(width=32),
    "double": st.floats(),
    "string": st.text(max_size=8),
    "bytes": st.binary(max_size=8),
}
ITEMS = ("int", "long", "float", "double")


@st.composite
def field_types(draw: st.DrawFn, depth: int, names: itertools.count) -> tuple[Any, st.SearchStrategy[Any]]:
    """An Avro field type the fast path supports and a strategy for its values."""
    kind = draw(st.sampled_from([*SCALARS, "array", "record", "nullable"] if depth < 2 else [*SCALARS, "array"]))
    if kind in SCALARS:
        return kind, SCALARS[kind]
    if kind == "array":
        item = draw(st.sampled_from(ITEMS))
        return {"type": "array", "items": item}, st.lists(SCALARS[item], max_size=5)
    if kind == "record":
        return draw(records(depth + 1, names))
    inner, values = draw(
        field_types(depth + 1, names).filter(lambda t: not _is_record(t[0]) and not isinstance(t[0], list))
    )
    branches = draw(st.sampled_from([["null", inner], [inner, "null"]]))
    return branches, st.none() | values


def _is_record(avro: Any) -> bool:
    return isinstance(avro, dict) and avro.get("type") == "record"


@st.composite
def records(draw: st.DrawFn, depth: int, names: itertools.count) -> tuple[dict[str, Any], st.SearchStrategy[Any]]:
    count = draw(st.integers(1, 5))
    typed = [draw(field_types(depth, names)) for _ in range(count)]
    schema = {
        "type": "record",
        "name": f"R{next(names)}",
        "fields": [{"name": f"f{i}", "type": avro} for i, (avro, _) in enumerate(typed)],
    }
    return schema, st.fixed_dictionaries({f"f{i}": values for i, (_, values) in enumerate(typed)})


@st.composite
def schemas_and_rows(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    schema, rows = draw(records(0, itertools.count()))
    return schema, draw(st.lists(rows, min_size=1, max_size=20))


def bits(value: Any) -> Any:
    """A value with each float as its IEEE bits (NaN == NaN when the bits are equal; -0.0 != 0.0)."""
    if isinstance(value, float):
        return struct.pack("<d", value) if not math.isnan(value) else ("nan", struct.pack("<d", value))
    if isinstance(value, list):
        return [bits(v) for v in value]
    if isinstance(value, np.ndarray):
        return bits(value.tolist())
    return value


def pluck(record: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        record = record[part]
    return record


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schemas_and_rows())
def test_fast_walker_decodes_what_the_avro_deserializer_decodes(example: tuple[dict[str, Any], list[Any]]) -> None:
    schema, rows = example
    context = SerializationContext(f"property-{next(SUBJECTS)}", MessageField.VALUE)
    serializer = AvroSerializer(CLIENT, json.dumps(schema), conf={"auto.register.schemas": True})
    values = [serializer(row, context) for row in rows]
    stock = AvroDeserializer(CLIENT)
    expected = [stock(value, context) for value in values]

    paths = [leaf.path for leaf in flatten(parse_schema(schema))]
    decoder = AvroSchemaDecoder(parse_schema(schema), None, lambda v: stock(v, context), "property")
    columns = decoder.columns(values, paths, 5)

    assert decoder.stock_values == 0 and decoder.deferred_batches == 0  # the fast path decoded every value
    for path in paths:
        column = columns[path]
        got = [bits(v) for v in (column.tolist() if isinstance(column, np.ndarray) else column)]
        assert got == [bits(pluck(record, path)) for record in expected], path


def test_values_the_fast_path_cannot_take_fall_back_to_the_stock_decoder() -> None:
    schema = {"type": "record", "name": "Big", "fields": [{"name": "n", "type": "long"}, {"name": "m", "type": "int"}]}
    context = SerializationContext("property-fallback", MessageField.VALUE)
    serializer = AvroSerializer(CLIENT, json.dumps(schema))
    values = [serializer({"n": n, "m": 1}, context) for n in (2**63 - 1, -(2**63), 5)]
    stock = AvroDeserializer(CLIENT)
    decoder = AvroSchemaDecoder(parse_schema(schema), None, lambda v: stock(v, context), "fallback")
    columns = decoder.columns(values, ["n", "m"], 5)
    assert columns == {"n": [2**63 - 1, -(2**63), 5], "m": [1, 1, 1]}
    assert decoder.deferred_batches == 1 and decoder.stock_values == 3

    enum = {
        "type": "record",
        "name": "E",
        "fields": [{"name": "e", "type": {"type": "enum", "name": "K", "symbols": ["A", "B"]}}],
    }
    serializer = AvroSerializer(CLIENT, json.dumps(enum))
    values = [serializer({"e": "B"}, SerializationContext("property-enum", MessageField.VALUE))]
    decoder = AvroSchemaDecoder(parse_schema(enum), None, lambda v: stock(v, context), "enum")
    assert decoder.columns(values, ["e"], 5) == {"e": ["B"]} and decoder.stock_values == 1

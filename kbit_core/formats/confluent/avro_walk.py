"""A fast decoder for any Avro writer schema of the shapes it supports, built from the schema fetched: the record's
fields walked in order by straight-line code generated from the schema, the requested fields gathered into columns
(numbers and float arrays as numpy arrays). Decodes what fastavro (confluent-kafka's AvroDeserializer) decodes, bit
for bit, or raises (Defer for an encoding it leaves to fastavro; UnsupportedSchema at build time).

Supported: records of boolean, int, long, float, double, string, bytes, arrays of int/long/float/double, nested
records, and unions of null with any of those but a record; no logical types, enums, fixed, maps or other unions.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kbit_core.formats.fast.avro import read_blocks, read_ints, read_long
from kbit_core.formats.fast.base import Defer, UnsupportedSchema

SCALARS = ("boolean", "int", "long", "float", "double", "string", "bytes")
NUMBER_ITEMS = {"int": "long", "long": "long", "float": "<f4", "double": "<f8"}


class Leaf:
    """One field of the flattened record: its dotted path, Avro type (a scalar or ``array:<item>``) and, for a union
    with null, the branch that holds null (None when the field is not a union)."""

    def __init__(self, path: str, avro: str, null_branch: int | None) -> None:
        self.path, self.avro, self.null_branch = path, avro, null_branch


def _leaf_type(ftype: Any, named: dict[str, Any], where: str) -> tuple[str | dict[str, Any], int | None]:
    if isinstance(ftype, list):
        if len(ftype) != 2 or "null" not in ftype:
            raise UnsupportedSchema(f"field {where}: a union other than [null, T] is not handled by the fast path")
        null_branch = ftype.index("null")
        if isinstance(ftype[1 - null_branch], list):
            raise UnsupportedSchema(f"field {where}: a union inside a union is not Avro")
        inner, _ = _leaf_type(ftype[1 - null_branch], named, where)
        if isinstance(inner, dict):
            raise UnsupportedSchema(f"field {where}: a nullable record is not handled by the fast path")
        return inner, null_branch
    if isinstance(ftype, str) and ftype in named:
        ftype = named[ftype]
    if isinstance(ftype, dict) and "logicalType" in ftype:
        raise UnsupportedSchema(f"field {where}: logical type {ftype['logicalType']!r} is not handled by the fast path")
    if isinstance(ftype, dict) and ftype.get("type") in SCALARS:
        return ftype["type"], None
    if ftype in SCALARS:
        return ftype, None
    if isinstance(ftype, dict) and ftype.get("type") == "record":
        return ftype, None
    if isinstance(ftype, dict) and ftype.get("type") == "array" and ftype["items"] in NUMBER_ITEMS:
        return f"array:{ftype['items']}", None
    raise UnsupportedSchema(f"field {where} of type {ftype!r} is not handled by the fast path")


def flatten(schema: dict[str, Any], prefix: str = "") -> list[Leaf]:
    """The record's leaves in the order they are encoded, nested records flattened into dotted paths."""
    named = schema.get("__named_schemas", {})
    leaves = []
    for field in schema["fields"]:
        path = f"{prefix}{field['name']}"
        ftype, null_branch = _leaf_type(field["type"], named, path)
        if isinstance(ftype, dict):
            leaves += flatten({**ftype, "__named_schemas": named}, f"{path}.")
        else:
            leaves.append(Leaf(path, ftype, null_branch))
    return leaves


_VARINT = """\
{indent}byte = buf[pos]
{indent}if byte < 0x80:
{indent}    {target} = (byte >> 1) ^ -(byte & 1)
{indent}    pos += 1
{indent}else:
{indent}    {target}, pos = read_long(buf, pos)"""


def _value_lines(avro: str, out: str | None, indent: str) -> list[str]:
    """Code reading one value of ``avro`` at ``pos``, appending it to ``out`` (None: skipped)."""
    put = (lambda expr: [f"{indent}{out}({expr})"]) if out else (lambda expr: [])
    if avro in ("int", "long"):
        return [_VARINT.format(indent=indent, target="number"), *put("number")]
    if avro == "boolean":
        flag = [f"{indent}flag = buf[pos]", f"{indent}if flag > 1:", f"{indent}    raise Defer('boolean byte')"]
        return [*flag, *put("flag == 1"), f"{indent}pos += 1"]
    if avro in ("float", "double"):
        size = 4 if avro == "float" else 8
        return [*put(f"view[pos:pos + {size}]"), f"{indent}pos += {size}"]
    if avro in ("string", "bytes"):
        value = "str(view[pos:end], 'utf-8')" if avro == "string" else "buf[pos:end]"
        return [
            _VARINT.format(indent=indent, target="length"),
            f"{indent}end = pos + length",
            f"{indent}if length < 0 or end > len(buf):",
            f"{indent}    raise Defer('string or bytes past the value')",
            *(put(value) if out else [f"{indent}{value}"] if avro == "string" else []),
            f"{indent}pos = end",
        ]
    item = avro.removeprefix("array:")
    if NUMBER_ITEMS[item] == "long":
        return [f"{indent}numbers, pos = read_ints(buf, pos)", *put("numbers")]
    size = 4 if item == "float" else 8
    return [
        f"{indent}blocks, pos = read_blocks(buf, pos, {size})",
        *put(f"[view[s:s + {size} * n] for s, n in blocks]"),
    ]


def walker_source(leaves: Sequence[Leaf], captured: dict[str, int]) -> str:
    """The source of ``walk(buf, view, pos, outs) -> end``; ``outs[i]`` is the append of captured field i."""
    lines = ["def walk(buf, view, pos, outs):"]
    for leaf in leaves:
        slot = captured.get(leaf.path)
        out = f"outs[{slot}]" if slot is not None else None
        if leaf.null_branch is None:
            lines += _value_lines(leaf.avro, out, "    ")
            continue
        lines += [
            _VARINT.format(indent="    ", target="branch"),
            f"    if branch == {leaf.null_branch}:",
            f"        {out}(None)" if out else "        pass",
            f"    elif branch == {1 - leaf.null_branch}:",
            *_value_lines(leaf.avro, out, "        "),
            "    else:",
            "        raise Defer('union branch')",
        ]
    lines.append("    if pos > len(buf):\n        raise Defer('the record runs past the value')\n    return pos")
    return "\n".join(lines)


class AvroColumnWalker:
    """Decodes schemaless Avro values of one writer schema into the columns of the requested fields."""

    def __init__(self, schema: dict[str, Any], fields: Sequence[str]) -> None:
        self.leaves = {leaf.path: leaf for leaf in flatten(schema)}
        self.fields = [f for f in fields if f in self.leaves]
        source = walker_source(list(self.leaves.values()), {f: i for i, f in enumerate(self.fields)})
        namespace = {"read_long": read_long, "read_blocks": read_blocks, "read_ints": read_ints, "Defer": Defer}
        exec(compile(source, "<avro column walker>", "exec"), namespace)  # noqa: S102 - our own generated code
        self._walk = namespace["walk"]

    def columns(self, values: Sequence[bytes], offset: int = 0) -> dict[str, Any]:
        """Each captured field's column over ``values`` (the Avro record starting at ``offset`` in each)."""
        gathered: list[list[Any]] = [[] for _ in self.fields]
        outs = [column.append for column in gathered]
        walk = self._walk
        for value in values:
            if walk(value, memoryview(value), offset, outs) != len(value):
                raise Defer("trailing bytes after the Avro record")
        return {path: self._finish(self.leaves[path], column) for path, column in zip(self.fields, gathered)}

    @staticmethod
    def _finish(leaf: Leaf, column: list[Any]) -> Any:
        avro, nullable = leaf.avro, leaf.null_branch is not None
        if avro in ("float", "double"):
            fmt = "<f" if avro == "float" else "<d"
            if nullable:
                return [None if v is None else struct.unpack(fmt, v)[0] for v in column]
            return np.frombuffer(b"".join(column), dtype="<f4" if avro == "float" else "<f8")
        if avro in ("int", "long", "boolean"):
            return column if nullable else np.array(column, dtype=np.int64 if avro != "boolean" else np.bool_)
        if avro.startswith("array:"):
            return _array_column(avro.removeprefix("array:"), column, nullable)
        return column


def _array_column(item: str, column: list[Any], nullable: bool) -> Any:
    """Arrays of numbers: one 2-D array when every record holds as many (and none is null), else a list of 1-D arrays
    (None for a null)."""
    dtype = {"int": np.int64, "long": np.int64, "float": "<f4", "double": "<f8"}[item]
    if item in ("int", "long"):
        rows = [None if v is None else np.array(v, dtype=np.int64) for v in column]
    else:
        rows = [None if v is None else np.frombuffer(b"".join(v), dtype=dtype) for v in column]
    if not nullable and rows and len({len(r) for r in rows}) == 1:
        return np.stack(rows) if rows[0].size else np.empty((len(rows), 0), dtype=dtype)
    return rows

"""Fast schemaless-Avro decoding: walk each value's bytes along a plan compiled from the topic's schema; float
array blocks and ``bytes`` pixels are cut out as raw little-endian slices and become one ``np.frombuffer`` per
batch, instead of one Python float per pixel (fastavro's cost). A block's values of one length that differ from the
first only in index, label and pixels are read as the columns of a byte matrix instead (``base.by_length``).

The plan covers records of ints, longs, floats, doubles, strings, bytes and arrays of numbers, nested records
flattened into their fields in order; the image record must have ``data``, ``shape``, ``label`` and a
``meta`` record with an ``index``. Any other schema is refused (UnsupportedSchema) and the stock codec runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kbit_core.formats.avro_codec import AvroCodec
from kbit_core.formats.fast.base import Columns, Defer, FastPath, UnsupportedSchema, by_length, read_varint

# plan step kinds
VARINT, STRING, BYTES, FLOAT, DOUBLE, FLOAT_ARRAY, INT_ARRAY = range(7)
FIXED_SIZES = {FLOAT: 4, DOUBLE: 8}
CAPTURED = {("data",): "data", ("shape",): "shape", ("label",): "label", ("meta", "index"): "index"}


def _resolve(schema: Any, named: dict[str, Any]) -> Any:
    return named[schema] if isinstance(schema, str) and schema in named else schema


def compile_plan(schema: dict[str, Any], layout: str) -> tuple[tuple[int, str | None], ...]:
    """The image record's fields as ``(kind, captured name or None)`` steps, nested records flattened.

    Raises:
        UnsupportedSchema: a field type the walker does not handle, or a missing captured field.
    """
    named = schema.get("__named_schemas", {})
    steps: list[tuple[int, str | None]] = []

    def add(record: Any, path: tuple[str, ...]) -> None:
        for f in _resolve(record, named)["fields"]:
            where, ftype = (*path, f["name"]), _resolve(f["type"], named)
            name = CAPTURED.get(where)
            if ftype in ("int", "long") and name in (None, "label", "index"):
                steps.append((VARINT, name))
            elif ftype in ("string", "bytes") and name in (None, "data"):
                steps.append((STRING if ftype == "string" else BYTES, name))
            elif ftype in ("float", "double") and name is None:
                steps.append((FLOAT if ftype == "float" else DOUBLE, name))
            elif isinstance(ftype, dict) and ftype.get("type") == "record" and name is None:
                add(ftype, where)
            elif (
                isinstance(ftype, dict)
                and ftype.get("type") == "array"
                and ftype["items"] == "float"
                and name in (None, "data")
            ):
                steps.append((FLOAT_ARRAY, name))
            elif (
                isinstance(ftype, dict)
                and ftype.get("type") == "array"
                and ftype["items"] in ("int", "long")
                and name in (None, "shape")
            ):
                steps.append((INT_ARRAY, name))
            else:
                raise UnsupportedSchema(f"field {'.'.join(where)} of type {ftype!r} is not handled by the fast path")

    add(schema, ())
    found = {name for _, name in steps if name in CAPTURED.values()}
    missing = sorted(set(CAPTURED.values()) - found)
    if missing:
        raise UnsupportedSchema(f"the image record has no field(s) {missing}")
    if {name: kind for kind, name in steps}["data"] != (BYTES if layout == "bytes" else FLOAT_ARRAY):
        raise UnsupportedSchema(f"field data is not the {layout} layout's type")
    return tuple(steps)


def read_long(buf: bytes, pos: int) -> tuple[int, int]:
    """Zigzag varint at ``pos`` -> (value, next position); Defer past 9 bytes (fastavro wraps at 64 bits there)."""
    raw, pos = read_varint(buf, pos, 9)
    return (raw >> 1) ^ -(raw & 1), pos


def block_count(buf: bytes, pos: int) -> tuple[int, int]:
    """An array block's item count (0 ends the array) and where its items start: a negative count is followed
    by the block's byte size, skipped here."""
    count, pos = read_long(buf, pos)
    if count < 0:
        count = -count
        _, pos = read_long(buf, pos)
    return count, pos


def read_blocks(buf: bytes, pos: int, item_size: int) -> tuple[list[tuple[int, int]], int]:
    """An array of fixed-size items: its blocks as (start, item count), and the position after it."""
    blocks = []
    while True:
        count, pos = block_count(buf, pos)
        if count == 0:
            return blocks, pos
        blocks.append((pos, count))
        pos += count * item_size
        if pos > len(buf):
            raise Defer("array block runs past the value")


def read_ints(buf: bytes, pos: int) -> tuple[list[int], int]:
    """An array of ints or longs: its items, and the position after it."""
    numbers = []
    while True:
        count, pos = block_count(buf, pos)
        if count == 0:
            return numbers, pos
        for _ in range(count):
            number, pos = read_long(buf, pos)
            numbers.append(number)


def zigzag(value: int) -> bytes:
    """The Avro encoding of ``value`` (zigzag varint), for the byte patterns the generated walker expects."""
    rest, out = (value << 1) ^ (value >> 63), bytearray()
    while rest > 0x7F:
        out.append(rest & 0x7F | 0x80)
        rest >>= 7
    out.append(rest)
    return bytes(out)


_VARINT = """\
    byte = buf[pos]
    if byte < 0x80:
        {target} = (byte >> 1) ^ -(byte & 1)
        pos += 1
    else:
        {target}, pos = read_long(buf, pos)
"""


def record_walker(steps: Sequence[tuple[int, str | None]], layout: str, shape: Sequence[int]) -> Any:
    """A function ``walk(buf, view, pos, indices, labels, pieces) -> end`` for one record, generated as straight-line
    code from the plan: per record the plan's interpretation would cost more than the parsing itself.

    The single-block float array and the expected shape are matched as whole byte patterns (what every Avro
    writer emits for them); anything else takes the general block parser, so any valid encoding decodes.
    """
    size = int(np.prod(shape))
    head, shape_bytes = zigzag(size), zigzag(len(shape)) + b"".join(zigzag(d) for d in shape) + b"\x00"
    lines = ["def walk(buf, view, pos, indices, labels, pieces):"]
    for kind, name in steps:
        if kind == VARINT:
            lines.append(_VARINT.format(target={"label": "label", "index": "index"}.get(name or "", "_")))
            if name in ("label", "index"):
                lines.append(f"    {'labels' if name == 'label' else 'indices'}.append({name})")
        elif kind in FIXED_SIZES:
            lines.append(f"    pos += {FIXED_SIZES[kind]}")
        elif kind in (STRING, BYTES):
            lines.append(_VARINT.format(target="length"))
            lines.append(
                "    end = pos + length\n    if length < 0 or end > len(buf):\n"
                "        raise Defer('string or bytes past the value')"
            )
            if kind == STRING:
                lines.append("    str(view[pos:end], 'utf-8')  # fastavro refuses invalid UTF-8 too")
            elif name == "data":
                lines.append(
                    f"    if length != {size}:\n        raise Defer('pixel byte count')\n"
                    "    pieces.append(view[pos:end])"
                )
            lines.append("    pos = end")
        elif kind == FLOAT_ARRAY and name == "data":
            stop = len(head) + 4 * size
            lines.append(
                f"    if buf[pos:pos + {len(head)}] == {head!r} and buf[pos + {stop}] == 0:\n"
                f"        pieces.append(view[pos + {len(head)}:pos + {stop}])\n"
                f"        pos += {stop + 1}\n"
                "    else:\n"
                "        blocks, pos = read_blocks(buf, pos, 4)\n"
                f"        if sum(count for _, count in blocks) != {size}:\n"
                "            raise Defer('pixel count')\n"
                "        pieces.extend(view[start:start + 4 * count] for start, count in blocks)"
            )
        elif kind == FLOAT_ARRAY:
            lines.append("    _, pos = read_blocks(buf, pos, 4)")
        elif name == "shape":
            lines.append(
                f"    if buf[pos:pos + {len(shape_bytes)}] == {shape_bytes!r}:\n"
                f"        pos += {len(shape_bytes)}\n"
                "    else:\n"
                "        numbers, pos = read_ints(buf, pos)\n"
                f"        if numbers != {list(shape)!r}:\n"
                "            raise Defer('shape')"
            )
        else:
            lines.append("    _, pos = read_ints(buf, pos)")
    lines.append("    if pos > len(buf):\n        raise Defer('the record runs past the value')\n    return pos")
    namespace = {"read_long": read_long, "read_blocks": read_blocks, "read_ints": read_ints, "Defer": Defer}
    exec(compile("\n".join(lines), f"<avro walker {layout} {tuple(shape)}>", "exec"), namespace)  # noqa: S102
    return namespace["walk"]


# Below this many values a batch is walked value by value: the matrix check costs more than it saves.
TEMPLATE_MIN_VALUES = 16


VARINT_SHIFTS = 7 * np.arange(9, dtype=np.int64)


def zigzag_column(varints: np.ndarray) -> np.ndarray:
    """Zigzag varints of one byte length, one per row of ``varints`` (n, width), as int64; Defer unless every row
    has its continuation bits exactly where a varint of that width has them."""
    width = varints.shape[1]
    if width > 9 or (varints[:, :-1] < 0x80).any() or (varints[:, -1] >= 0x80).any():
        raise Defer("varints of another byte length")
    # the 7-bit groups are disjoint, so their sum is the varint; 9 groups end at bit 62, inside an int64
    raw = ((varints & 0x7F).astype(np.int64) << VARINT_SHIFTS[:width]).sum(axis=1)
    return (raw >> 1) ^ -(raw & 1)


MAX_TEMPLATES = 8


class Template(NamedTuple):
    """A walked value's index, label and pixel spans, and the positions and bytes of everything else."""

    spans: dict[str, tuple[int, int]]
    fixed: np.ndarray
    fixed_bytes: np.ndarray


class AvroWalker:
    """Walks schemaless Avro values along a compiled plan and gathers one batch's columns."""

    def __init__(
        self, steps: tuple[tuple[int, str | None], ...], layout: str, shape: tuple[int, ...], records_per_message: int
    ) -> None:
        self.steps, self.layout, self.size, self.rpm = steps, layout, int(np.prod(shape)), records_per_message
        self._record = record_walker(steps, layout, shape)
        self._templates: dict[int, Template] = {}  # by value length

    def columns(self, values: Sequence[bytes]) -> Columns:
        if self.rpm > 1 or len(values) < TEMPLATE_MIN_VALUES:
            return self._walked(values)
        # Values of one length usually differ only in index, label and pixels (an index varint grows a byte at
        # 64, 8,192, 1,048,576...): each length is read as one matrix.
        indices, labels, pixels = by_length(values, self._group)
        return indices, labels, pixels.reshape(-1)  # a copy where the pixels are still a view of the matrix

    def _group(self, values: list[bytes]) -> Columns:
        if len(values) >= TEMPLATE_MIN_VALUES:
            try:
                return self.by_template(np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), -1))
            except Defer:
                pass  # a value differs from the first beyond its index, label and pixels: walk each one
        indices, labels, pixels = self._walked(values)
        return indices, labels, pixels.reshape(len(indices), self.size)

    def by_template(self, rows: np.ndarray) -> Columns:
        """Values of one length, the rows of ``rows``, that equal a walked value (the last matrix's of that length,
        else the first row) except in their index, label and pixels, whose varints have that value's byte lengths,
        parse along the same path: their columns are cut out of the matrix (the pixels as a strided view)."""
        template = self._templates.get(rows.shape[1])
        if template is None or (rows[:, template.fixed] != template.fixed_bytes).any():
            template = self._template(rows[0].tobytes())
            if (rows[:, template.fixed] != template.fixed_bytes).any():
                raise Defer("a value differs from the first outside its index, label and pixels")
        numbers = {
            name: zigzag_column(rows[:, start:stop]) for name, (start, stop) in template.spans.items() if name != "data"
        }
        start, stop = template.spans["data"]
        data = rows[:, start:stop]
        pixels = data if self.layout == "bytes" else data.view("<f4").astype(np.float32)
        return numbers["index"], numbers["label"], pixels

    def _template(self, value: bytes) -> Template:
        """``value`` walked, its variable spans and the bytes outside them; kept for its length's next matrix (a
        few lengths at most: another length's matrix replaces them all once there are more)."""
        if self._walked([value])[0].size != 1:
            raise Defer("the first value does not hold one record")
        spans = self._spans(value)
        edges = [0, *sorted(e for span in spans.values() for e in span), len(value)]
        fixed = np.concatenate([np.arange(start, stop) for start, stop in zip(edges[::2], edges[1::2])])
        template = Template(spans, fixed, np.frombuffer(value, dtype=np.uint8)[fixed])
        if len(self._templates) >= MAX_TEMPLATES:
            self._templates = {}
        self._templates[len(value)] = template
        return template

    def _spans(self, value: bytes) -> dict[str, tuple[int, int]]:
        """Where the first value's index and label varints and its pixel payload lie (one float block only)."""
        spans, pos = {}, 0
        for kind, name in self.steps:
            start = pos
            if kind == VARINT:
                _, pos = read_long(value, pos)
            elif kind in FIXED_SIZES:
                pos += FIXED_SIZES[kind]
            elif kind in (STRING, BYTES):
                length, pos = read_long(value, pos)
                start, pos = pos, pos + length
            elif kind == FLOAT_ARRAY:
                blocks, pos = read_blocks(value, pos, 4)
                if name == "data":
                    if len(blocks) != 1:
                        raise Defer("pixels in several array blocks")
                    start, count = blocks[0]
                    spans[name] = (start, start + 4 * count)
                continue
            else:
                _, pos = read_ints(value, pos)
            if name in ("index", "label", "data"):
                spans[name] = (start, pos)
        return spans

    def _walked(self, values: Sequence[bytes]) -> Columns:
        indices: list[int] = []
        labels: list[int] = []
        pieces: list[memoryview] = []
        walk = self._record
        for value in values:
            if self.rpm == 1:
                end = walk(value, memoryview(value), 0, indices, labels, pieces)
            else:
                end = self._batch(value, indices, labels, pieces)
            if end != len(value):
                raise Defer("trailing bytes after the Avro record")
        if self.layout == "bytes":
            pixels = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        else:
            pixels = np.frombuffer(b"".join(pieces), dtype="<f4").astype(np.float32, copy=False)
        if pixels.size != len(indices) * self.size or len(labels) != len(indices):
            raise Defer("a record has the wrong number of pixels")
        return np.array(indices, dtype=np.int64), np.array(labels, dtype=np.int64), pixels

    def _batch(self, value: bytes, indices: list[int], labels: list[int], pieces: list[memoryview]) -> int:
        pos, items, view = 0, 0, memoryview(value)
        while True:
            count, pos = block_count(value, pos)
            if count == 0:
                break
            for _ in range(count):
                pos = self._record(value, view, pos, indices, labels, pieces)
            items += count
        if not 1 <= items <= self.rpm:
            raise Defer(f"value holds {items} records")
        return pos


class FastAvroCodec(FastPath, AvroCodec):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        image_schema = self._image_schema()
        self._walker = AvroWalker(
            compile_plan(image_schema, self.layout), self.layout, self.image_shape, self.records_per_message
        )

    def _image_schema(self) -> dict[str, Any]:
        if self.records_per_message == 1:
            return self._schema
        named = self._schema.get("__named_schemas", {})
        fields = self._schema["fields"]
        items = _resolve(fields[0]["type"], named) if len(fields) == 1 else None
        if not (isinstance(items, dict) and items.get("type") == "array"):
            raise UnsupportedSchema("the batch record is not a single array of image records")
        return {**_resolve(items["items"], named), "__named_schemas": named}

    def _fast_columns(self, values: Sequence[bytes]) -> Columns:
        return self._walker.columns(values)

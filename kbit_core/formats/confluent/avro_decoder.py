"""Avro values of one writer schema into columns, resolved to a reader schema: kbit's fast walker built from the
writer schema where it takes the schema (and the reader asks nothing of it but fields it has, or top-level fields
added with a default), else the stock decoder, counted and logged once per schema."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

import fastavro

from kbit_core.formats.confluent.avro_walk import AvroColumnWalker, Leaf, flatten
from kbit_core.formats.fast.base import UnsupportedSchema
from kbit_core.formats.records import columns_of

log = logging.getLogger(__name__)

# fastavro decodes a default of these types from its JSON form (bytes from a string, ...): the stock decoder does it.
PLAIN_DEFAULTS = (int, float, str, bool, type(None))


class AvroSchemaDecoder:
    """Decodes schemaless Avro records of ``writer`` (parsed by fastavro), resolved to ``reader`` (None: the writer).

    ``stock(value)`` is the stock decoder of one value (confluent-kafka's AvroDeserializer, or fastavro's
    ``schemaless_reader`` for a schema file) returning the record as a dict; ``name`` names the schema in logs."""

    def __init__(
        self,
        writer: dict[str, Any],
        reader: dict[str, Any] | None,
        stock: Callable[[bytes], Any],
        name: str,
        fast: bool = True,
    ) -> None:
        self.writer, self.reader, self.stock, self.name, self.fast = writer, reader, stock, name, fast
        self._plans: dict[tuple[str, ...], tuple[AvroColumnWalker, dict[str, Any]] | None] = {}
        self.stock_values = 0  # values decoded by the stock decoder (the fast path could not take them)
        self.deferred_batches = 0

    def columns(self, values: Sequence[bytes], fields: Sequence[str], offset: int) -> dict[str, Any]:
        """Every requested field's column over ``values``, each holding an Avro record from ``offset`` on."""
        plan = self._plan(tuple(fields)) if self.fast else None
        if plan is not None:
            walker, fill = plan
            try:
                out = walker.columns(values, offset)
            except Exception as exc:  # noqa: BLE001 - anything unexpected is the stock decoder's to judge
                self.deferred_batches += 1
                log.debug("%s: fast path deferred %d value(s) to the stock decoder: %r", self.name, len(values), exc)
            else:
                return {path: out[path] if path in out else [fill[path]] * len(values) for path in fields}
        self.stock_values += len(values)
        records = [self.stock(value) for value in values]
        return columns_of(records, fields)

    def _plan(self, fields: tuple[str, ...]) -> tuple[AvroColumnWalker, dict[str, Any]] | None:
        """The walker for ``fields`` and the fill value of each requested field the writer lacks; None (logged once)
        where the fast path cannot take the schemas."""
        if fields not in self._plans:
            try:
                fill = self._fill(fields)
                self._plans[fields] = (AvroColumnWalker(self.writer, [f for f in fields if f not in fill]), fill)
            except UnsupportedSchema as exc:
                log.warning("%s decodes with the stock Avro decoder: %s", self.name, exc)
                self._plans[fields] = None
        return self._plans[fields]

    def _fill(self, fields: Sequence[str]) -> dict[str, Any]:
        """Requested fields the writer lacks: the reader's default (a top-level field) or None (not in the reader
        either). A field both have must have the same type in both, or the stock decoder resolves it."""
        writer = {leaf.path: leaf for leaf in flatten(self.writer)}
        records = [path for path in fields if any(leaf.startswith(f"{path}.") for leaf in writer)]
        if records:
            raise UnsupportedSchema(f"field {records[0]} is a record: the stock decoder gives it as a dict")
        if self.reader is None:
            return {path: None for path in fields if path not in writer}
        reader = {leaf.path: leaf for leaf in flatten(self.reader)}
        defaults = {f["name"]: f for f in self.reader["fields"]}
        fill = {}
        for path in fields:
            if path in writer and path in reader:
                if not _same(writer[path], reader[path]):
                    raise UnsupportedSchema(f"field {path} changes type from writer to reader schema")
            elif path in writer or path not in reader:
                fill[path] = None  # not in the reader schema: resolved records lack it
            elif path in defaults and isinstance(defaults[path].get("default", ...), PLAIN_DEFAULTS):
                fill[path] = defaults[path]["default"]
            else:
                raise UnsupportedSchema(f"field {path} is added by the reader schema without a plain default")
        return fill


def _same(writer: Leaf, reader: Leaf) -> bool:
    return writer.avro == reader.avro and (writer.null_branch is None) == (reader.null_branch is None)


def schemaless_stock(writer: dict[str, Any], reader: dict[str, Any] | None) -> Callable[[bytes], Any]:
    """fastavro's own decoding of one schemaless value (for a schema file: there is no registry framing)."""
    return lambda value: fastavro.schemaless_reader(io.BytesIO(value), writer, reader)

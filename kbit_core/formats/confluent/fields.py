"""A writer schema's fields as the mapping checks them (``records.WriterSchema``): Avro, JSON Schema and Protobuf
types onto ``records.FIELD_KINDS``, nested records as dotted paths; types with no kind (maps, enums of Avro,
unions of several types) are left out."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kbit_core.formats.records import FieldType

AVRO_KINDS = {
    "int": "int",
    "long": "int",
    "float": "float",
    "double": "float",
    "string": "string",
    "bytes": "bytes",
    "boolean": "bool",
    "fixed": "bytes",
    "enum": "string",
}
JSON_KINDS = {"integer": "int", "number": "float", "string": "string", "boolean": "bool", "object": "record"}
PROTO_KINDS = {
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED32,
            FieldDescriptor.TYPE_FIXED64,
            FieldDescriptor.TYPE_SFIXED32,
            FieldDescriptor.TYPE_SFIXED64,
        ),
        "int",
    ),
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_DOUBLE: "float",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_ENUM: "int",
    FieldDescriptor.TYPE_MESSAGE: "record",
}


def _avro_type(ftype: Any, named: dict[str, Any]) -> tuple[Any, bool]:
    """(the type without null, nullable) of an Avro field type; a union of several non-null types stays a list."""
    if isinstance(ftype, list):
        rest = [t for t in ftype if t != "null"]
        return (_avro_type(rest[0], named)[0] if len(rest) == 1 else rest), len(rest) < len(ftype)
    if isinstance(ftype, str) and ftype in named:
        return named[ftype], False
    return ftype, False


def _avro_kind(ftype: Any, named: dict[str, Any]) -> str | None:
    if isinstance(ftype, str):
        return AVRO_KINDS.get(ftype)
    if isinstance(ftype, dict):
        kind = ftype.get("type")
        if kind == "record":
            return "record"
        if kind == "array":
            items = _avro_kind(_avro_type(ftype["items"], named)[0], named)
            wanted = f"array<{items}>"
            return wanted if items in ("int", "float", "string", "record") else None
        return AVRO_KINDS.get(kind) if kind in ("fixed", "enum") else _avro_kind(kind, named)
    return None


def avro_fields(schema: dict[str, Any], prefix: str = "") -> dict[str, FieldType]:
    """Every field of a parsed Avro record schema (fastavro's ``parse_schema``), nested records' fields too."""
    named = schema.get("__named_schemas", {})
    out: dict[str, FieldType] = {}
    for field in schema.get("fields", ()):
        ftype, nullable = _avro_type(field["type"], named)
        kind = _avro_kind(ftype, named)
        if kind is None:
            continue
        path = f"{prefix}{field['name']}"
        out[path] = FieldType(path, kind, nullable)
        if kind == "record":
            out.update(avro_fields({**ftype, "__named_schemas": named}, f"{path}."))
    return out


def json_schema_fields(schema: dict[str, Any], prefix: str = "") -> dict[str, FieldType]:
    """Every property of a JSON Schema object (``properties``), nested objects' too; ``type: [X, "null"]`` is
    nullable."""
    out: dict[str, FieldType] = {}
    for name, prop in (schema.get("properties") or {}).items():
        types = prop.get("type")
        types = types if isinstance(types, list) else [types]
        rest = [t for t in types if t != "null"]
        if len(rest) != 1:
            continue
        path = f"{prefix}{name}"
        if rest[0] == "array":
            items = (prop.get("items") or {}).get("type")
            kind = f"array<{JSON_KINDS.get(items) if items != 'boolean' else None}>"
            if kind not in ("array<int>", "array<float>", "array<string>", "array<record>"):
                continue
        elif rest[0] in JSON_KINDS:
            kind = JSON_KINDS[rest[0]]
        else:
            continue
        out[path] = FieldType(path, kind, len(rest) < len(types))
        if kind == "record":
            out.update(json_schema_fields(prop, f"{path}."))
    return out


def protobuf_fields(descriptor: Descriptor, prefix: str = "") -> dict[str, FieldType]:
    """Every field of a Protobuf message, nested messages' too (maps left out); fields with presence (optional,
    messages, oneofs) are nullable."""
    out: dict[str, FieldType] = {}
    for field in descriptor.fields:
        kind = PROTO_KINDS.get(field.type)
        if kind is None or (field.message_type is not None and field.message_type.GetOptions().map_entry):
            continue
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated:
            if kind == "bytes" or kind == "bool":
                continue
            kind = f"array<{kind}>"
        out[path] = FieldType(path, kind, field.has_presence and not repeated)
        if kind == "record":
            out.update(protobuf_fields(field.message_type, f"{path}."))
    return out

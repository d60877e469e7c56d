"""Columns of dotted-path fields: taken from decoded Protobuf messages, and put back in the
values' order after the values were decoded in groups (one per writer schema)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message


def message_value(message: Message, path: str) -> Any:
    """The value at the dotted ``path`` of a Protobuf message as Python data: None for a field with presence that
    is not set (or a path the message lacks); repeated fields as lists, messages as dicts."""
    value: Any = message
    for part in path.split("."):
        if not isinstance(value, Message):
            return None
        field = value.DESCRIPTOR.fields_by_name.get(part)
        if field is None or (field.has_presence and not value.HasField(part)):
            return None
        value = getattr(value, part)
    return python_value(value)


def python_value(value: Any) -> Any:
    if isinstance(value, Message):
        return {field.name: python_value(v) for field, v in value.ListFields()}
    if hasattr(value, "__len__") and not isinstance(value, str | bytes):  # a repeated field
        return [python_value(v) for v in value]
    return value


def in_order(groups: Sequence[tuple[np.ndarray, dict[str, Any]]], fields: Sequence[str], n: int) -> dict[str, Any]:
    """One column per field over all ``n`` values from ``(positions, columns)`` of each group: a numpy array when
    every group's is one of the same dtype and row shape, else a list."""
    if len(groups) == 1:
        return dict(groups[0][1])
    out: dict[str, Any] = {}
    for path in fields:
        parts = [columns[path] for _, columns in groups]
        arrays = all(isinstance(p, np.ndarray) for p in parts)
        if arrays and len({(p.dtype, p.shape[1:]) for p in parts}) == 1:
            column = np.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype)
        else:
            column = np.empty(n, dtype=object)
            parts = [list(p) if isinstance(p, np.ndarray) and p.ndim > 1 else p for p in parts]
            parts = [p.tolist() if isinstance(p, np.ndarray) else p for p in parts]
        for (positions, _), part in zip(groups, parts):
            if column.dtype == object:
                for position, value in zip(positions.tolist(), part):
                    column[position] = value
            else:
                column[positions] = part
        out[path] = column if column.dtype != object else column.tolist()
    return out

"""The data-only encoding (JSON plus typed arrays) for every value kbit sends between processes or hosts.

Nothing kbit receives over a socket is unpickled: configs, rank results, collective payloads (RNG states,
loader positions, metrics) all travel as UTF-8 JSON. Tuples, numpy arrays and torch tensors, which JSON
lacks, are tagged objects, so a value decodes to exactly the types it was encoded from. Decoding builds
only dicts, lists, tuples, strings, numbers, booleans, None, arrays and tensors: no code runs.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import numpy as np

_TAG = "__kbit__"


def dumps(value: Any) -> str:
    """``value`` as JSON text; raises TypeError naming the first unsupported type."""
    return json.dumps(_encode(value), separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    """The value :func:`dumps` encoded; raises ValueError on text that is not hand-off JSON."""
    return _decode(json.loads(text))


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"hand-off dict keys must be strings, got {[type(k).__name__ for k in value]}")
        if _TAG in value:
            raise TypeError(f"hand-off dicts may not use the reserved key {_TAG!r}")
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(item) for item in value]}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return _array("ndarray", value)
    torch = _torch_if_loaded()
    if torch is not None and isinstance(value, torch.Tensor):
        return _array("tensor", value.detach().cpu().numpy())
    raise TypeError(f"cannot send a {type(value).__module__}.{type(value).__qualname__} over kbit's hand-off encoding")


def _array(kind: str, array: np.ndarray) -> dict[str, Any]:
    if array.dtype.hasobject:
        raise TypeError("cannot send an array of Python objects over kbit's hand-off encoding")
    contiguous = np.ascontiguousarray(array)
    return {
        _TAG: kind,
        "dtype": contiguous.dtype.str,
        "shape": list(contiguous.shape),
        "data": base64.b64encode(contiguous.tobytes()).decode("ascii"),
    }


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {key: _decode(item) for key, item in value.items()}
    if kind == "tuple":
        return tuple(_decode(item) for item in value["items"])
    if kind in ("ndarray", "tensor"):
        dtype = np.dtype(value["dtype"])
        if dtype.hasobject:
            raise ValueError("hand-off arrays may not hold Python objects")
        array = np.frombuffer(base64.b64decode(value["data"]), dtype=dtype).reshape(value["shape"]).copy()
        if kind == "ndarray":
            return array
        # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
        import torch

        return torch.from_numpy(array)
    raise ValueError(f"unknown hand-off tag {kind!r}")


def _torch_if_loaded() -> Any:
    return sys.modules.get("torch")

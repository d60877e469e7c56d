"""Objects the user names by import path ('package.module:attribute'): models, losses, metrics, optimizers, schedulers
and datasets all resolve here, so a misspelled path fails the same way wherever it is named: one line with the
setting, the path and what is wrong. The bottom layer, so that the dataset sources below the training code can
resolve a dataset factory too."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kbit_core.errors import ConfigError


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the 'package.module:attribute' form (built-in names have no colon)."""
    return ":" in name


def import_object(spec: str, setting: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """The callable that ``spec`` names: a key of ``builtins``, or 'package.module:attribute'.

    Raises:
        ConfigError: one line naming ``setting`` and ``spec``: neither form, a module that does not import, or an
            attribute that is missing or not callable.
    """
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        known = "/".join(builtins) + " nor " if builtins else ""
        raise ConfigError(f"{setting}={spec!r} is neither {known}'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{setting}={spec!r}: cannot import {module_name!r}: {exc}") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"{setting}={spec!r}: {module_name} has no callable {attr!r}")
    return found

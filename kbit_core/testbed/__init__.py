"""A simulated multi-host cluster on this machine: network namespaces, a TLS Kafka broker, Spark standalone, Ray.

API: ``up(bed_dir, BedOptions()) -> BedState``, ``down(bed_dir) -> list[str]``,
``status(bed_dir) -> BedStatus``, ``load_state(bed_dir) -> BedState | None``, ``running_bed_dir() -> Path | None``
``reshape(bed_dir, link)``, ``start_registry(bed_dir)``/``stop_registry(bed_dir) -> BedState`` (the Schema Registry on a running bed's
driver host)
and ``require_bed_for(addresses)``, the guard to call before connecting to any configured address.
"""

from kbit_core.testbed.bed import (
    down,
    missing_prerequisites,
    require_bed_for,
    reshape,
    running_bed_dir,
    start_registry,
    status,
    stop_registry,
    up,
)
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.state import DEFAULT_SUBNET, BedOptions, BedState, BedStatus, load_state, state_path

__all__ = [
    "DEFAULT_SUBNET",
    "BedOptions",
    "BedState",
    "BedStatus",
    "TestbedError",
    "down",
    "load_state",
    "missing_prerequisites",
    "require_bed_for",
    "reshape",
    "running_bed_dir",
    "start_registry",
    "state_path",
    "status",
    "stop_registry",
    "up",
]

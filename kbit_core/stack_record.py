"""The machine-local record of the services a running local stack serves (broker, Prefect, MLflow, Schema Registry, Ray
head with its token file), so that a profile with any workdir finds them without naming the stack's workdir.

`kbit stack up` writes its entry, `kbit stack down` removes it. The file lives in ``$KBIT_STATE_DIR`` (default
``$XDG_STATE_HOME/kbit``, else ``~/.local/state/kbit``; never ``~/.ray``) and holds addresses and paths only: the
Ray token itself stays in the stack's workdir. An entry counts only while its process runs, so a stack killed
without `down` is never joined.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel

from kbit_core.service import pid_alive, port_open

STATE_DIR_VARIABLE = "KBIT_STATE_DIR"
RECORD_FILE = "stack.json"


class RayHeadRecord(BaseModel):
    address: str  # host:port of the head's GCS
    token_file: Path
    pid: int


class StackRecord(BaseModel):
    workdir: Path
    broker: str | None = None  # bootstrap servers of the embedded broker
    prefect_api_url: str | None = None
    mlflow_url: str | None = None
    ray_head: RayHeadRecord | None = None
    registry_url: str | None = None  # the local Schema Registry's Confluent-compatible API, when the stack runs one


def state_dir() -> Path:
    """``$KBIT_STATE_DIR``, else ``$XDG_STATE_HOME/kbit``, else ``~/.local/state/kbit``."""
    explicit = os.environ.get(STATE_DIR_VARIABLE)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "kbit"


def record_path() -> Path:
    return state_dir() / RECORD_FILE


def recorded_stacks() -> list[StackRecord]:
    """Every stack's entry as written (running or not); none when the file is missing or unreadable."""
    try:
        entries = json.loads(record_path().read_text())["stacks"]
        return [StackRecord.model_validate(entry) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _write(stacks: list[StackRecord]) -> None:
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole and renamed into place: a reader never sees half a file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{RECORD_FILE}.")
    with os.fdopen(fd, "w") as out:
        json.dump({"stacks": [s.model_dump(mode="json") for s in stacks]}, out, indent=2)
    os.replace(tmp, path)


def save(record: StackRecord) -> Path:
    """Record ``record`` in place of any earlier entry for its workdir; returns the file."""
    _write([s for s in recorded_stacks() if s.workdir != record.workdir] + [record])
    return record_path()


def forget(workdir: Path) -> None:
    """Remove the entry of the stack kept in ``workdir`` (nothing when it has none)."""
    stacks = recorded_stacks()
    kept = [s for s in stacks if s.workdir != workdir]
    if kept != stacks:
        _write(kept)


def running_ray_head() -> RayHeadRecord | None:
    """The Ray head a running local stack recorded: its process alive and its port accepting connections."""
    for stack in recorded_stacks():
        head = stack.ray_head
        if head is not None and pid_alive(head.pid):
            host, port = head.address.rsplit(":", 1)
            if port_open(host, int(port)):
                return head
    return None


def running_registry_url() -> str | None:
    """The Schema Registry URL a running local stack recorded (its port accepting connections): what a profile that
    names no registry uses for registry-framed topics."""
    for stack in recorded_stacks():
        if stack.registry_url is not None:
            where = urlsplit(stack.registry_url)
            if where.hostname is not None and where.port is not None and port_open(where.hostname, where.port):
                return stack.registry_url
    return None

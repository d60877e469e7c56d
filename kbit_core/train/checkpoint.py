"""Checkpoints: atomic rank-0 files (or DeepSpeed's sharded dirs plus a JSON side file), keep-last-K, resume.

A DDP checkpoint is one file ``step-00000012.pt`` written to a hidden temp name and renamed into place, so
a visible file is always complete. A DeepSpeed checkpoint is a directory ``step-00000012/`` written by the
engine on every rank; rank 0 writes ``kbit_state.json`` into it last, so the side file marks completeness.
Both hold the same train state and one entry per rank (RNG states and loader position, as plain types).
Nothing from a checkpoint is unpickled beyond tensors, plain containers and allowlisted value types: DDP files
load with ``torch.load(weights_only=True)``, the side file is JSON, and DeepSpeed reads its own files through
``deepspeed_checkpoint.WeightsOnlyCheckpointEngine`` (``weights_only=True`` with DeepSpeed's loss-scaler,
ZeRO-stage and fragment-address types allowed).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kbit_core.config import CheckpointConfig
from kbit_core.errors import ConfigError

log = logging.getLogger(__name__)

# State keys: the same in every checkpoint and for every engine.
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
GRAD_SCALER = "grad_scaler"
EMA = "ema"
TRAIN_STATE = "train_state"
RANKS = "ranks"  # one {"rng": ..., "loader": ...} per rank, indexed by rank
SIDE_FILE = "kbit_state.json"

_NAME = re.compile(r"^step-(\d+)(\.pt)?$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (by optimizer step)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if not match:
            continue
        complete = path.is_file() if match.group(2) else (path / SIDE_FILE).is_file()
        if complete:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None (used for ``resume: latest`` and restarts)."""
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(cfg: CheckpointConfig, directory: Path | None, base: Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: None for 'none' (or 'latest' with nothing saved yet).

    Args:
        cfg: The checkpoint section.
        directory: The resolved checkpoint directory (None when checkpointing is off).
        base: What a relative resume path is relative to (the run directory).
    """
    if cfg.resume == "none":
        return None
    if cfg.resume == "latest":
        if directory is None:
            raise ConfigError("checkpoint.resume=latest needs checkpoint.dir")
        return latest_checkpoint(directory)
    path = base / cfg.resume
    if not (path.is_file() or (path / SIDE_FILE).is_file()):
        raise ConfigError(f"checkpoint.resume={cfg.resume!r} is not a complete checkpoint (file or DeepSpeed dir)")
    return path


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory rather than a single file."""
    return path.is_dir()


def read_file(path: Path) -> dict[str, Any]:
    """Load a single-file checkpoint onto the CPU without unpickling arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_side_file(path: Path) -> dict[str, Any]:
    """The train state and per-rank entries of a DeepSpeed checkpoint directory."""
    return json.loads((path / SIDE_FILE).read_text())


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch, cuda) as ints and lists, JSON- and weights_only-safe."""
    version, mt_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"keys": np_keys.tolist(), "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state().tolist(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


def _to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor cloned to the CPU, so training can go on while it is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(value) for value in obj)
    return obj


def _atomic_write(path: Path, write: Any) -> None:
    """Write through ``write(tmp_path)`` to a hidden temp file in the same dir, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Checkpointer:
    """Rank 0's checkpoint writer for one directory: atomic files, optional background saving, keep last K."""

    def __init__(self, directory: str | Path, keep_last: int, async_save: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def write_file(self, name: str, state: dict[str, Any]) -> Path:
        """Save ``state`` as ``<dir>/<name>.pt``; with async_save the write runs in a background thread.

        The state is copied to the CPU first, so the caller may keep training at once. A failed background
        write is raised by the next save or by :meth:`wait`.
        """
        self.wait()
        path = self.directory / f"{name}.pt"
        snapshot = _to_cpu(state)
        if not self.async_save:
            self._write(path, snapshot)
            return path
        self._pending = threading.Thread(target=self._write_in_background, args=(path, snapshot),
                                         name=f"kbit-checkpoint-{name}", daemon=False)
        self._pending.start()
        return path

    def write_side_file(self, name: str, meta: dict[str, Any]) -> Path:
        """Mark the DeepSpeed checkpoint ``<dir>/<name>/`` complete by writing its JSON side file."""
        path = self.directory / name / SIDE_FILE

        def write(tmp: str) -> None:
            Path(tmp).write_text(json.dumps(meta))

        _atomic_write(path, write)
        self.prune()
        return path.parent

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints."""
        for old in list_checkpoints(self.directory)[: -self.keep_last]:
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
            log.info("removed old checkpoint %s", old)

    def _write(self, path: Path, snapshot: dict[str, Any]) -> None:
        _atomic_write(path, lambda tmp: torch.save(snapshot, tmp))
        self.prune()

    def _write_in_background(self, path: Path, snapshot: dict[str, Any]) -> None:
        try:
            self._write(path, snapshot)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

"""Checkpoints: atomic rank-0 files (or DeepSpeed's sharded dirs plus a JSON side file), keep-last-K, resume.

A DDP checkpoint is one file ``step-00000012.pt`` written to a hidden temp name and renamed into place, so
a visible file is always complete. A DeepSpeed checkpoint is a directory ``step-00000012/`` written by the
engine on every rank; rank 0 writes ``kbit_state.json`` into it last, so the side file marks completeness.
Both hold the same train state and one entry per rank (RNG states and loader position, as plain types).
Nothing from a checkpoint is unpickled beyond tensors, plain containers and allowlisted value types: DDP files
load with ``torch.load(weights_only=True)``, the side file is JSON, and DeepSpeed reads its own files through
``deepspeed_checkpoint.weights_only_engine_type`` (``weights_only=True`` with DeepSpeed's loss-scaler,
ZeRO-stage and fragment-address types allowed).

Checkpoints belong to a *lineage*: one training run and its restarts. Each lineage writes into its own
subdirectory ``<checkpoint.dir>/<lineage id>/`` with a ``lineage.json`` naming the settings a resume must share
(model, data, shard plan, world size, engine, optimizer, seed), so a new run never prunes, mixes with or
resumes another run's files. ``resume: latest`` continues the newest compatible lineage that has not finished.
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
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.errors import ConfigError
from kbit_core.train.elastic import world_size_pinned_by
from kbit_core.train.models import build_model

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
# In a DeepSpeed checkpoint directory: the whole model's fp32 state dict, consolidated from the ZeRO shards.
CONSOLIDATED_FILE = "model_fp32.pt"
LINEAGE_FILE = "lineage.json"

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
    """The newest complete checkpoint of ``directory`` itself, or else of its newest lineage that has one."""
    checkpoints = list_checkpoints(directory)
    if checkpoints:
        return checkpoints[-1]
    for lineage in reversed(list_lineages(directory)):
        checkpoints = list_checkpoints(lineage)
        if checkpoints:
            return checkpoints[-1]
    return None


def lineage_settings(cfg: KbitConfig) -> dict[str, Any]:
    """The settings a checkpoint can only be resumed under: what defines the model, its data and its trajectory.

    Epochs are left out on purpose: resuming a lineage with more epochs trains it further.
    """
    train, dataset = cfg.train, cfg.dataset
    # Absolute, as the ranks see it (the driver hands them driver-relative paths made absolute).
    path = str(dataset.path.expanduser().resolve()) if dataset.path is not None else None
    return {
        "topic": cfg.produce.topic_for(dataset)
        if cfg.train.mode == "batch"
        else cfg.stream.topic_for(dataset, cfg.produce),
        "dataset": {**dataset.model_dump(mode="json"), "path": path},
        "produce.variant": cfg.produce.variant.model_dump(mode="json"),
        "produce.partitions": cfg.produce.partitions,
        "shard": cfg.shard.model_dump(mode="json"),
        # A stream checkpoint keeps positions per partition, and a DDP or ZeRO one is re-planned (Trainer._restore;
        # ZeRO's partitions through a universal checkpoint), so any world size may continue them; a tensor-parallel
        # or pipeline layout fixes it.
        "launch.num_processes": cfg.launch.num_processes if world_size_pinned_by(cfg) else None,
        "deepspeed": [cfg.deepspeed.enabled, cfg.deepspeed.zero_stage if cfg.deepspeed.enabled else None],
        "train.model": train.model.model_dump(mode="json"),
        "train.optim": train.optim.model_dump(mode="json"),
        **{
            f"train.{key}": getattr(train, key)
            for key in (
                "global_batch_size",
                "grad_accum_steps",
                "precision",
                "ema_decay",
                "seed",
                "max_steps_per_epoch",
            )
        },
    }


def list_lineages(directory: str | Path) -> list[Path]:
    """The lineage directories under ``directory``, oldest first (by the creation time their lineage.json holds)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    lineages = [path for path in directory.iterdir() if (path / LINEAGE_FILE).is_file()]
    return sorted(lineages, key=lambda path: (read_lineage(path)["created"], path.name))


def read_lineage(lineage: Path) -> dict[str, Any]:
    return json.loads((lineage / LINEAGE_FILE).read_text())


def _write_lineage(lineage: Path, record: dict[str, Any]) -> None:
    _atomic_write(lineage / LINEAGE_FILE, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=2)))


def new_lineage(directory: Path, settings: dict[str, Any]) -> Path:
    """Create ``<directory>/<UTC time>-<random>/`` with its ``lineage.json``; a checkpoint.dir that cannot be
    created or written is a configuration error (restarting would fail the same way)."""
    lineage = directory / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    try:
        lineage.mkdir(parents=True)
        _write_lineage(lineage, {"id": lineage.name, "created": time.time(), "finished": False, "settings": settings})
    except OSError as exc:
        raise ConfigError(f"checkpoint.dir={directory} is not writable: {exc}") from None
    return lineage


def _differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [f"{key}: {saved.get(key)!r} != {wanted[key]!r}" for key in wanted if saved.get(key) != wanted[key]]


def find_resumable(directory: Path, settings: dict[str, Any]) -> Path | None:
    """The newest complete checkpoint of the newest unfinished lineage in ``directory`` written under ``settings``;
    each lineage passed over is logged with the reason."""
    for lineage in reversed(list_lineages(directory)):
        record = read_lineage(lineage)
        differences = _differences(record["settings"], settings)
        checkpoints = list_checkpoints(lineage)
        if differences:
            log.warning(
                "not resuming lineage %s: it was written with other settings (%s)", lineage, "; ".join(differences)
            )
        elif record["finished"]:
            log.info("not resuming lineage %s: it finished training (resume one of its checkpoints by path)", lineage)
        elif not checkpoints:
            log.info("not resuming lineage %s: it holds no complete checkpoint", lineage)
        else:
            log.warning("resuming lineage %s from %s", lineage.name, checkpoints[-1])
            return checkpoints[-1]
    return None


def resolve_resume(cfg: KbitConfig, directory: Path | None, base: Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: None for 'none' (or 'latest' with nothing to resume).

    ``checkpoint.resume`` may also name a lineage directory, for its newest checkpoint: a driver restarting a
    run pins the lineage that run started, whatever other lineages the directory holds.

    Args:
        cfg: The run's config (its lineage settings decide which lineage 'latest' may continue).
        directory: The resolved checkpoint directory (None when checkpointing is off).
        base: What a relative resume path is relative to (the run directory).
    """
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "latest":
        if directory is None:
            raise ConfigError("checkpoint.resume=latest needs checkpoint.dir")
        found = find_resumable(directory, lineage_settings(cfg))
        if found is None:
            log.warning(
                "checkpoint.resume=latest: no unfinished lineage in %s was written with this run's settings; "
                "starting from scratch",
                directory,
            )
        return found
    path = base / resume
    if (path / LINEAGE_FILE).is_file():  # a lineage directory: its newest checkpoint (what a restart pins)
        checkpoints = list_checkpoints(path)
        return checkpoints[-1] if checkpoints else None
    if not (path.is_file() or (path / SIDE_FILE).is_file()):
        raise ConfigError(
            f"checkpoint.resume={resume!r} is not a complete checkpoint (file or DeepSpeed dir) nor a lineage directory"
        )
    return path


def open_lineage(
    cfg: KbitConfig, run_dir: Path, is_main: bool, sharded: bool
) -> tuple[Checkpointer | None, Path | None]:
    """Rank 0's writer (None elsewhere, or without checkpoint.dir) and the checkpoint every rank resumes from.

    The writer continues the lineage of the checkpoint being resumed when it is one written with the same
    settings, and otherwise starts a new lineage, so it never prunes or overwrites another run's files.
    ``sharded``: DeepSpeed writes the checkpoints, so async_save does not apply.
    """
    directory = run_dir / cfg.checkpoint.dir if cfg.checkpoint.dir is not None else None
    resume_from = resolve_resume(cfg, directory, run_dir)
    if directory is None or not is_main:
        return None, resume_from
    if sharded and cfg.checkpoint.async_save:
        log.warning("checkpoint.async_save is ignored with DeepSpeed, which writes its own sharded checkpoints")
    settings = lineage_settings(cfg)
    lineage = resume_from.parent if resume_from is not None else None
    if (
        lineage is None
        or lineage.parent != directory
        or not (lineage / LINEAGE_FILE).is_file()
        or _differences(read_lineage(lineage)["settings"], settings)
    ):
        lineage = new_lineage(directory, settings)
    return Checkpointer(
        lineage, cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save and not sharded
    ), resume_from


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory rather than a single file."""
    return path.is_dir()


def read_file(path: Path) -> dict[str, Any]:
    """Load a single-file checkpoint onto the CPU without unpickling arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def write_consolidated(checkpoint: Path, state: dict[str, torch.Tensor]) -> Path:
    """Save a DeepSpeed checkpoint's consolidated fp32 weights into its directory."""
    path = checkpoint / CONSOLIDATED_FILE
    _atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def loadable_weights(path: Path) -> Path | None:
    """The file holding ``path``'s whole model: the checkpoint file itself, a DeepSpeed checkpoint's consolidated
    weights, or None (a DeepSpeed checkpoint without them: a pipeline's, or one written before training ended)."""
    if not is_sharded(path):
        return path
    consolidated = path / CONSOLIDATED_FILE
    return consolidated if consolidated.is_file() else None


def load_model(cfg: KbitConfig, path: Path) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """``cfg``'s model with the weights in ``path`` (a state dict, or a checkpoint holding one under 'model', or a
    DeepSpeed checkpoint with consolidated weights), in eval mode, and the image shape it takes."""
    weights = loadable_weights(path)
    if weights is None:
        raise ConfigError(f"{path} is a DeepSpeed checkpoint without consolidated weights ({CONSOLIDATED_FILE})")
    state = read_file(weights)
    if isinstance(state.get(MODEL), Mapping):
        state = state[MODEL]
    source = open_source(cfg.dataset)
    model = build_model(cfg.train.model, source.image_shape, source.num_classes)
    model.load_state_dict(state)
    model.eval()
    return model, tuple(source.image_shape)


def read_side_file(path: Path) -> dict[str, Any]:
    """The train state and per-rank entries of a DeepSpeed checkpoint directory."""
    return json.loads((path / SIDE_FILE).read_text())


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch, cuda) as ints and lists, JSON- and weights_only-safe."""
    version, mt_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {
            "keys": np_keys.tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
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
    np.random.set_state(
        ("MT19937", np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
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
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"checkpoint directory {self.directory} cannot be created: {exc}") from None
        self.keep_last = keep_last
        self.kept: str | None = None  # the best checkpoint's name (checkpoint.keep_best), exempt from pruning
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
        self._pending = threading.Thread(
            target=self._write_in_background, args=(path, snapshot), name=f"kbit-checkpoint-{name}", daemon=False
        )
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

    def finish(self) -> None:
        """Wait for the last save, then mark the lineage finished, so ``resume: latest`` never continues it."""
        self.wait()
        if (self.directory / LINEAGE_FILE).is_file():
            _write_lineage(self.directory, {**read_lineage(self.directory), "finished": True})

    def keep(self, name: str) -> None:
        """Exempt the checkpoint ``name`` (the best one so far) from pruning, instead of the one kept before."""
        self.kept = name

    def find(self, name: str) -> Path | None:
        """The complete checkpoint called ``name`` in this lineage, if it is still there."""
        return next((p for p in list_checkpoints(self.directory) if p.name.removesuffix(".pt") == name), None)

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints and the kept one."""
        candidates = [p for p in list_checkpoints(self.directory) if p.name.removesuffix(".pt") != self.kept]
        for old in candidates[: -self.keep_last]:
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

"""Run an entry function on every rank through Spark's TorchDistributor and bring failures back typed.

The hand-off is data only: each rank gets the config as JSON once and builds its own ``KbitConfig``;
arguments and rank 0's result travel as hand-off JSON. TorchDistributor reports any worker failure as a
generic RuntimeError (local_mode=True) or Py4JJavaError (local_mode=False); here each rank runs inside
:func:`run_rank`, which writes its own traceback to ``<run_dir>/errors/rank<r>.txt`` before re-raising,
and the torchrun agents' failure summaries are read from the relayed output, so the driver raises one
error naming the rank that caused the failure: its own Python error, or how its process died.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from kbit_core import handoff
from kbit_core.config import KbitConfig
from kbit_core.errors import DistributedError
from kbit_core.launch.failures import (
    ExecutorLoss,
    OutputTail,
    RankExit,
    executor_loss,
    is_peer_failure,
    rank_exits,
    rank_lines,
)
from kbit_core.launch.spark import check_barrier_slots, clean_worker_tmp, get_spark, spark_dir, wait_for_executors
from kbit_core.service import owner_gone, owner_token
from kbit_core.train.distributed import LAUNCHER_PID_ENV, broadcast_from_main

log = logging.getLogger(__name__)

_RESULT_KEY = "kbit/rank0-result"
# How long one wait on the torchrun agent's store may last before the rank looks whether the agent still lives.
AGENT_STORE_WAIT_S = 5.0
_MAX_SECONDARY_LINES = 8
# Set to 1 by `kbit --debug`: the launcher's output is then shown whole, tracebacks included.
DEBUG_ENV = "KBIT_DEBUG"
# In each run directory: the driver that made it (see kbit_core.service.owner_token).
RUN_OWNER_FILE = ".kbit-owner"

# One TorchDistributor run at a time per process: runs share the session's worker TMPDIR and errors dir.
_run_lock = threading.Lock()


class WorkerFailedError(DistributedError):
    """A rank failed; ``exception_type`` is the qualified name of what it raised (e.g. 'ValueError')."""

    def __init__(self, message: str, *, rank: str, exception_type: str, host: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.exception_type, self.host = rank, exception_type, host


class ExecutorLostError(WorkerFailedError):
    """Spark lost the executor (JVM or host) that ran a rank; a restart runs on the executors left or relaunched."""

    def __init__(self, loss: ExecutorLoss, cfg: KbitConfig) -> None:
        rank = f"rank{loss.rank}" if loss.rank is not None else "a rank"
        message = (
            f"distributed run failed ({describe(cfg)}): Spark lost executor {loss.executor} on host "
            f"{loss.host or 'unknown'} (its JVM or its host died), and {rank} with it"
        )
        super().__init__(message, rank=rank, exception_type="ExecutorLostFailure", host=loss.host)
        self.loss = loss


class RankDiedError(WorkerFailedError):
    """A rank's process ended without a Python error: killed by a signal, or exited with a code."""

    def __init__(self, message: str, exit_: RankExit) -> None:
        kind = exit_.signal_name or f"exit code {exit_.exitcode}"
        super().__init__(message, rank=f"rank{exit_.rank}", exception_type=kind, host=exit_.host)
        self.exit = exit_


RankEntry = Callable[..., Any]  # entry(cfg: KbitConfig, *args) -> a hand-off-encodable result


def errors_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "errors"


def run_distributed(entry: RankEntry, cfg: KbitConfig, *args: Any, result_type: Any = None) -> Any:
    """Run ``entry(cfg, *args)`` on ``cfg.launch.num_processes`` ranks; return rank 0's result.

    The hand-off is data only: the config crosses once as JSON and each rank validates it into its own
    ``KbitConfig``; ``args`` and the result cross as hand-off JSON (:mod:`kbit_core.handoff`), never as
    pickles, and ``result_type`` (a type pydantic validates, e.g. ``list[Sample]``) types the result on
    the driver. ``entry`` must be a module-level function; one from a module the workers cannot import
    (a test file, a notebook helper) is shipped by value.

    Raises:
        DistributedError: the launch settings do not fit the SparkSession, or a worker raised (the
            message holds that worker's traceback, also kept in ``<run_dir>/errors/``).
    """
    # pyspark takes seconds to import: loaded only where Spark is used
    from pyspark.ml.torch.distributor import TorchDistributor

    launch = cfg.launch
    session = get_spark(cfg)
    check_barrier_slots(session, launch)
    wait_for_executors(session, launch)
    _ship_by_value_if_needed(entry)
    errors = errors_dir(cfg.run_dir)
    with _run_lock:
        shutil.rmtree(errors, ignore_errors=True)
        try:
            distributor = TorchDistributor(
                num_processes=launch.num_processes, local_mode=launch.local_mode, use_gpu=launch.use_gpu
            )
        except RuntimeError as exc:
            raise DistributedError(f"TorchDistributor refused launch settings {describe(cfg)}: {exc}") from exc
        log.info("launching %s on %s", getattr(entry, "__qualname__", entry), describe(cfg))
        with _run_tmpdir(cfg.run_dir):
            tail = OutputTail(quiet_failures=os.environ.get(DEBUG_ENV) != "1")
            try:
                with tail.capturing():
                    text = distributor.run(
                        run_rank, entry, cfg.to_secret_json(), handoff.dumps(list(args)), str(errors)
                    )
            except Exception as exc:
                raise worker_failure(exc, errors, cfg, tail.text()) from exc
            finally:
                clean_worker_tmp()
    result = handoff.loads(text)
    return result if result_type is None else TypeAdapter(result_type).validate_python(result)


def describe(cfg: KbitConfig) -> str:
    launch = cfg.launch
    if launch.engine == "torchrun":
        return f"torchrun --standalone nproc_per_node={launch.num_processes} use_gpu={launch.use_gpu}"
    return (
        f"num_processes={launch.num_processes} local_mode={launch.local_mode} "
        f"use_gpu={launch.use_gpu} master={launch.master}"
    )


def run_rank(entry: RankEntry, config_json: str, args_json: str, error_dir: str) -> str:
    """Per-rank wrapper: build the config, run ``entry``, record a failure's traceback; rank 0's result as JSON."""
    rank = int(os.environ.get("RANK", "0"))
    agent = os.getppid()  # the torchrun agent (or other launcher process) that started this rank
    os.environ[LAUNCHER_PID_ENV] = str(agent)
    try:
        cfg = KbitConfig.from_json(config_json)
        result = entry(cfg, *handoff.loads(args_json))
        return _rank0_result(handoff.dumps(result), rank, float(cfg.launch.timeout_s), agent)
    except BaseException:
        record_traceback(Path(error_dir), rank)
        raise


def record_traceback(error_dir: Path, rank: int) -> None:
    """Write the exception being handled to ``error_dir/rank<r>.txt``; never mask it with a write error.

    On a multi-machine cluster the driver's run directory may not exist on this executor; the
    traceback then still reaches the driver's stderr through TorchDistributor's log stream.
    """
    text = traceback.format_exc()
    try:
        error_dir.mkdir(parents=True, exist_ok=True)
        (error_dir / f"rank{rank}.txt").write_text(text)
    except OSError as exc:
        print(f"kbit: cannot record rank {rank}'s traceback in {error_dir} ({exc}):\n{text}", file=sys.stderr)


def _rank0_result(text: str, rank: int, timeout_s: float, agent: int) -> str:
    """Rank 0's result text on every rank.

    In local_mode=True every rank writes its return value to the same output file and the last
    writer wins, so ranks must agree. The process group may already be destroyed by the entry; the
    torchrun agent's store (which outlives the workers) carries the text then. A rank whose agent
    (``agent``, its parent at start) is gone returns its own text: the agent's store went with it, and
    nobody is left to read a result (a cancelled job's agent is killed while its ranks, in sessions of
    their own, finish their final checkpoint). The agent may die while a rank talks to its store, so each
    wait is short and the agent is looked at again after it, for at most ``timeout_s`` in all.
    """
    # torch takes seconds to import: loaded where tensors are made, not by every importer of this module
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return text
    if dist.is_available() and dist.is_initialized():
        return broadcast_from_main(text)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return text
    deadline = time.monotonic() + timeout_s
    store = None
    while os.getppid() == agent:
        try:
            if store is None:
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    world_size=world_size,
                    is_master=False,
                    timeout=timedelta(seconds=min(AGENT_STORE_WAIT_S, timeout_s)),
                )
            if rank == 0:
                store.set(_RESULT_KEY, text)
                return text
            # The agent store is private to this torchrun job: only rank 0 of this job wrote the value.
            return store.get(_RESULT_KEY).decode()
        except RuntimeError:  # refused, reset or timed out (DistStoreError is one): the agent may be gone
            if time.monotonic() > deadline:
                raise
            store = None  # a connection the agent's death reset does not heal; a new one is refused or waits
    return text


def worker_failure(exc: Exception, errors: Path, cfg: KbitConfig, output: str) -> DistributedError:
    """One typed error for a failed run, decided from torchrun's records and the ranks' own tracebacks.

    A rank's own Python error wins; otherwise a rank that died without one (killed by a signal other than
    the SIGTERM torchrun sends the survivors, or exited with a code) is the cause, whichever rank's
    collateral error happened to be written first.
    """
    text = f"{output}\n{exc}"  # cluster mode: the task's exception carries its torchrun output tail
    exits = {e.rank: e for e in rank_exits(text)}
    reports = _rank_reports(errors)
    own = [(rank, report) for rank, report in reports if not is_peer_failure(report)]
    if own:
        return _raised(own + [r for r in reports if r not in own], exits, cfg, errors)
    reported = {rank for rank, _ in reports}
    died = sorted(exits.values(), key=lambda e: (e.signal_name in (None, "SIGTERM"), f"rank{e.rank}" in reported))
    if died and (died[0].signal_name not in (None, "SIGTERM") or f"rank{died[0].rank}" not in reported):
        return _died(died[0], text, cfg)
    lost = executor_loss(text)
    if lost:
        return ExecutorLostError(lost, cfg)
    if reports:
        return _raised(reports, exits, cfg, errors)
    if died:
        return _died(died[0], text, cfg)
    message = str(exc)
    if "BarrierJobSlotsNumberCheckFailed" in message:
        return DistributedError(
            f"Spark cannot schedule {cfg.launch.num_processes} barrier tasks at once on {cfg.launch.master} "
            f"(local_mode=false needs one free task slot per process); add executors/cores or use local_mode=true"
        )
    return DistributedError(
        f"distributed run failed ({describe(cfg)}) before any worker reported a Python error; "
        f"the launcher said: {message[-3000:]}"
    )


def _raised(
    reports: list[tuple[str, str]], exits: dict[int, RankExit], cfg: KbitConfig, errors: Path
) -> WorkerFailedError:
    (first, text), *others = reports
    exit_ = exits.get(int(first.removeprefix("rank")))
    where = f" on host {exit_.host}" if exit_ else ""
    lines = [f"distributed run failed ({describe(cfg)}); {first}{where} raised:", text]
    for rank, other in others:
        lines.append(f"--- {rank} also failed:")
        lines.extend(other.splitlines()[-_MAX_SECONDARY_LINES:])
    lines.append(f"(tracebacks kept in {errors})")
    also = f"; {len(others)} other rank(s) failed after it" if others else ""
    error = WorkerFailedError(
        f"{first}{where} raised: {exception_line(text)}{also} (distributed run: {describe(cfg)}; tracebacks in "
        f"{errors}, printed with --debug)",
        rank=first,
        exception_type=_exception_type(text),
        host=exit_.host if exit_ else None,
    )
    error.details = "\n".join(lines)
    return error


def exception_line(traceback_text: str) -> str:
    """The exception a traceback ends with, on one line and by its bare class name: 'CorruptRecordError: ... (topic=t,
    partition=1, offset=7)' from '...\\nkbit_core.errors.CorruptRecordError: ...'."""
    lines = traceback_text.rstrip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(("  File ", "Traceback "))), default=-1)
    tail = list(itertools.dropwhile(lambda line: line.startswith("    "), lines[last_frame + 1 :]))
    text = " ".join(line.strip() for line in tail) or traceback_text.strip()
    qualified, colon, message = text.partition(":")
    return f"{qualified.rsplit('.', 1)[-1]}{colon}{message}" if " " not in qualified else text


def _died(exit_: RankExit, output: str, cfg: KbitConfig) -> RankDiedError:
    tail = rank_lines(output, exit_.rank, _MAX_SECONDARY_LINES) or ["(no output of its own)"]
    message = "\n".join(
        [
            f"distributed run failed ({describe(cfg)}): {exit_.describe()}, with no Python error "
            f"(an OOM kill, a segfault, a kill -9 or a lost host); its last lines:",
            *tail,
        ]
    )
    return RankDiedError(message, exit_)


def _rank_reports(errors: Path) -> list[tuple[str, str]]:
    """(rank name, traceback) per rank that wrote one, the earliest first."""
    if not errors.is_dir():
        return []
    reports = sorted((path.stat().st_mtime, path.stem, path.read_text().rstrip()) for path in errors.glob("rank*.txt"))
    return [(rank, text) for _, rank, text in reports]


def _exception_type(traceback_text: str) -> str:
    """'kbit_core.errors.ConfigError' from a traceback's last line 'kbit_core.errors.ConfigError: ...'."""
    last = traceback_text.splitlines()[-1] if traceback_text else ""
    return last.split(":", 1)[0].strip()


@contextlib.contextmanager
def _run_tmpdir(run_dir: Path) -> Iterator[Path]:
    """Point TMPDIR (env and tempfile) at a fresh directory for one run and delete it afterwards.

    TorchDistributor's tmp*/train.py and every torchrun agent's torchelastic_* land there, including
    those a failed run would otherwise leave behind.
    """
    _remove_abandoned(spark_dir(run_dir))
    tmp = spark_dir(run_dir) / f"run-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    (tmp / RUN_OWNER_FILE).write_text(owner_token())
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    try:
        yield tmp
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned(directory: Path) -> None:
    """Delete the run directories in ``directory`` whose driver is gone without removing them (SIGKILL, the OOM
    killer): nothing else ever would."""
    for run in directory.glob("run-*"):
        owner = run / RUN_OWNER_FILE
        try:
            token = owner.read_text()
        except OSError:  # from a kbit that did not record its owner, or being created right now
            continue
        if owner_gone(token):
            log.warning("removing %s, left behind by driver %s, which is gone", run, token)
            shutil.rmtree(run, ignore_errors=True)


def _ship_by_value_if_needed(fn: Callable[..., Any]) -> None:
    """cloudpickle sends module-level functions by reference; ship the module itself when workers can't import it."""
    module_name = getattr(fn, "__module__", None)
    if module_name in (None, "__main__") or module_name not in sys.modules:
        return
    if not _importable_in_fresh_python(module_name.split(".")[0]):
        # pyspark takes seconds to import: loaded only where Spark is used
        from pyspark import cloudpickle

        log.info("workers cannot import %s; shipping it by value", module_name)
        cloudpickle.register_pickle_by_value(sys.modules[module_name])


@functools.lru_cache(maxsize=64)
def _importable_in_fresh_python(top_level: str) -> bool:
    """Whether a new interpreter with this environment (as torchrun starts them) finds ``top_level``."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, "-c", code, top_level], cwd=cwd, capture_output=True, timeout=60)
    return done.returncode == 0

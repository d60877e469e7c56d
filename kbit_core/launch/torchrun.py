"""Run an entry function on every rank with plain ``torchrun --standalone`` on this host: no Spark, no Java.

For one machine (a GPU box, a laptop without a JVM) and as the baseline ``kbit bench-train`` measures the
other launchers against. The contract is the distributor's: the config crosses once as JSON, arguments and
rank 0's result as hand-off JSON (in a private scratch directory, never pickled), every rank runs inside the
distributor's rank wrapper (so its traceback lands in ``<run_dir>/errors/``), and a failure is typed from
those tracebacks and torchrun's own report exactly as under Spark.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from kbit_core import handoff
from kbit_core.config import KbitConfig
from kbit_core.errors import DistributedError
from kbit_core.launch.distributor import RankEntry, describe, errors_dir, record_traceback, run_rank, worker_failure
from kbit_core.launch.failures import OutputTail

log = logging.getLogger(__name__)

_CALL_FILE, _RESULT_FILE = "call.json", "result.json"


def run_torchrun(entry: RankEntry, cfg: KbitConfig, *args: Any, result_type: Any = None) -> Any:
    """Run ``entry(cfg, *args)`` on ``cfg.launch.num_processes`` local ranks; return rank 0's result.

    Raises:
        DistributedError: ``entry`` is not importable by name, or a rank failed (``WorkerFailedError`` /
            ``RankDiedError`` naming it, as :func:`kbit_core.launch.distributor.run_distributed` raises).
    """
    module, qualname = _importable_name(entry)
    errors = errors_dir(cfg.run_dir)
    shutil.rmtree(errors, ignore_errors=True)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kbit-torchrun-", dir=cfg.run_dir))  # 0700: the config holds secrets
    try:
        call = {
            "module": module,
            "qualname": qualname,
            "config": cfg.to_secret_json(),
            "args": handoff.dumps(list(args)),
            "errors": str(errors),
        }
        call_file = scratch / _CALL_FILE
        call_file.touch(mode=0o600)
        call_file.write_text(json.dumps(call))
        launch = cfg.launch
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc_per_node={launch.num_processes}",
            "-m",
            __name__,
            str(scratch),
        ]
        # Ranks import the entry's module the way this process did (a test file, a script's folder).
        env = {**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        log.info("launching %s on %s", qualname, describe(cfg))
        returncode, output = _run_relaying_output(cmd, env)
        result_file = scratch / _RESULT_FILE
        if returncode != 0 or not result_file.is_file():
            failure = DistributedError(f"torchrun exited with code {returncode}; its last output:\n{output[-3000:]}")
            raise worker_failure(failure, errors, cfg, output)
        result = handoff.loads(result_file.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result if result_type is None else TypeAdapter(result_type).validate_python(result)


def _importable_name(entry: RankEntry) -> tuple[str, str]:
    module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", "")
    if module in (None, "__main__") or "<" in qualname:
        raise DistributedError(
            f"launch.engine=torchrun starts fresh interpreters that import the entry by name; {entry!r} is not a "
            f"module-level function of an importable module (move it out of __main__ or the enclosing function)"
        )
    return module, qualname


def _run_relaying_output(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run torchrun with its output shown as it comes and its tail kept for the failure report."""
    tail = OutputTail()
    with tail.capturing():
        with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                sys.stdout.write(line)
            returncode = process.wait()
    return returncode, tail.text()


def _rank_main(scratch: Path) -> None:
    call = json.loads((scratch / _CALL_FILE).read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:  # an entry that imports on the driver but not in a rank is that rank's own error, not a silent exit 1
        target: Any = importlib.import_module(call["module"])
        for part in call["qualname"].split("."):
            target = getattr(target, part)
    except BaseException:
        record_traceback(Path(call["errors"]), rank)
        raise
    text = run_rank(target, call["config"], call["args"], call["errors"])
    if rank == 0:
        (scratch / _RESULT_FILE).write_text(text)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))

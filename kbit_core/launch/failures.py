"""Why a distributed run died, read from torchrun's own failure records rather than from whichever rank spoke first.

When a worker dies, torchrun's agent tears the others down and prints a ``ChildFailedError`` summary with
one block per failed rank and a "Root Cause (first observed failure)" block: rank, host, exit code and the
signal. TorchDistributor relays that output to the driver (stdout in local mode, stderr through its log
stream in cluster mode, and the tail inside the task's exception); :class:`OutputTail` keeps the last lines
of both streams while the run lasts, and :func:`rank_exits` parses the summary.
"""

from __future__ import annotations

import collections
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

_BLOCK = re.compile(
    r"\[\d+\]:\s*\n\s*time\s*:\s*(?P<time>\S+)\s*\n\s*host\s*:\s*(?P<host>\S+)\s*\n"
    r"\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local_rank>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<exitcode>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)
_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK_LINE = re.compile(r"^\[rank(?P<rank>\d+)\]:")


_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "ProcessGroupGloo",
    "NCCL communicator was aborted",
)
_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure \(executor (?P<executor>[\w.-]+) exited")
_EXECUTOR_HOST = r"(?:Lost executor {id} on (?P<lost>[^\s:]+)|\((?P<task>[^\s()]+) executor {id}\))"
_BARRIER_TASK = re.compile(r"barrier task ResultTask\(\d+, (?P<partition>\d+)\) finished unsuccessfully")


@dataclass(frozen=True)
class ExecutorLoss:
    """Spark lost the executor (its JVM or its host) that ran a barrier task, i.e. a rank."""

    executor: str
    host: str | None
    rank: int | None  # the barrier task's partition, which TorchDistributor makes the node rank


def executor_loss(output: str) -> ExecutorLoss | None:
    """The executor loss Spark reported in ``output`` (its job failure message and logs), if any."""
    lost = _EXECUTOR_LOST.search(output)
    if lost is None:
        return None
    executor = lost["executor"]
    where = re.search(_EXECUTOR_HOST.format(id=re.escape(executor)), output)
    task = _BARRIER_TASK.search(output)
    return ExecutorLoss(
        executor=executor,
        host=(where["lost"] or where["task"]) if where else None,
        rank=int(task["partition"]) if task else None,
    )


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as torchrun recorded it."""

    rank: int
    host: str
    exitcode: int
    pid: int

    @property
    def signal_name(self) -> str | None:
        """'SIGKILL' for exit code -9; None when the process exited rather than being killed."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        how = f"killed by {self.signal_name}" if self.signal_name else f"exited with code {self.exitcode}"
        return f"rank {self.rank} on host {self.host} (pid {self.pid}) {how}"


def rank_exits(output: str) -> list[RankExit]:
    """Every failed rank in the ``ChildFailedError`` summaries of ``output`` (one per torchrun agent, so one per
    host in cluster mode), root causes first."""
    roots = {m.start() for at in _find_all(output, _ROOT_CAUSE) if (m := _BLOCK.search(output, at))}
    blocks = sorted(_BLOCK.finditer(output), key=lambda m: m.start() not in roots)
    exits: dict[int, RankExit] = {}
    for match in blocks:
        exits.setdefault(
            int(match["rank"]),
            RankExit(
                rank=int(match["rank"]), host=match["host"], exitcode=int(match["exitcode"]), pid=int(match["pid"])
            ),
        )
    return list(exits.values())


def _find_all(text: str, needle: str) -> Iterator[int]:
    at = text.find(needle)
    while at >= 0:
        yield at
        at = text.find(needle, at + 1)


def is_peer_failure(traceback_text: str) -> bool:
    """Whether a rank's traceback is a broken collective: it reports after the peer that died, but is not the cause."""
    return any(marker in traceback_text for marker in _PEER_FAILURE_MARKERS)


def rank_lines(output: str, rank: int, limit: int) -> list[str]:
    """The last ``limit`` lines torchrun prefixed with ``[rank<r>]:`` (that rank's own error output)."""
    return [line for line in output.splitlines() if (m := _RANK_LINE.match(line)) and int(m["rank"]) == rank][-limit:]


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_TRACEBACK_START = "Traceback (most recent call last):"
_ELASTIC_LOG = re.compile(r"^[WE]\d{4} [\d:.]+ \d+ torch/distributed/elastic/")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_RULE = re.compile(r"=+")


class FailureNoise:
    """Which lines of the launcher's output make up a failure report that kbit condenses into its one-line error
    (the tracebacks stay in ``<run_dir>/errors`` and ``--debug`` prints them): each rank's traceback (torchrun
    prefixes a rank's stderr with ``[rankN]:``; ranks' lines interleave) down to its exception line, torchrun's
    warnings about the failure, and its own ChildFailedError traceback with the summary box after it."""

    def __init__(self) -> None:
        # source prefix ("" for the agent) -> its traceback being hidden: the summary's '=====' lines still to come
        self._open: dict[str, int] = {}

    def hides(self, line: str) -> bool:
        rank = _RANK_PREFIX.match(line)
        prefix = rank[0] if rank else ""
        body = line[len(prefix) :]
        if prefix not in self._open:
            if body.startswith(_TRACEBACK_START):
                self._open[prefix] = 0
                return True
            return not prefix and _ELASTIC_LOG.match(body) is not None
        rules = self._open[prefix]
        if rules:  # the ChildFailedError summary box, up to its closing rule
            rules -= _RULE.fullmatch(body.strip()) is not None
            if rules:
                self._open[prefix] = rules
            else:
                del self._open[prefix]
        elif "ChildFailedError" in body:
            self._open[prefix] = 2
        elif body.strip() and not body.startswith((" ", _TRACEBACK_START, *_CHAINED)):
            del self._open[prefix]  # the exception line ends the traceback
        return True


class OutputTail:
    """The last lines written to stdout and stderr while :meth:`capturing` is active, still shown to the user;
    with ``quiet_failures``, less the :class:`FailureNoise`."""

    def __init__(self, max_lines: int = 400, quiet_failures: bool = False) -> None:
        self.quiet_failures = quiet_failures
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._partial = ""  # the current line until its newline arrives (print writes text and "\n" apart)
        self._lock = threading.Lock()

    def text(self) -> str:
        with self._lock:
            return "".join(self._lines) + self._partial

    @contextmanager
    def capturing(self) -> Iterator[OutputTail]:
        saved = sys.stdout, sys.stderr
        noise = FailureNoise() if self.quiet_failures else None
        sys.stdout, sys.stderr = _Tee(saved[0], self, noise), _Tee(saved[1], self, noise)
        try:
            yield self
        finally:
            sys.stdout, sys.stderr = saved

    def _add(self, text: str) -> None:
        with self._lock:
            lines = (self._partial + text).splitlines(keepends=True)
            self._partial = lines.pop() if lines and not lines[-1].endswith(("\n", "\r")) else ""
            self._lines.extend(lines)


class _Tee:
    """A text stream that writes through to ``inner`` (less the lines ``noise`` hides) and keeps a copy in ``tail``.
    TorchDistributor relays its output a whole line per write; a write without a line end is passed on as is."""

    def __init__(self, inner: TextIO, tail: OutputTail, noise: FailureNoise | None = None) -> None:
        self._inner, self._tail, self._noise = inner, tail, noise

    def write(self, text: str) -> int:
        self._tail._add(text)
        if self._noise is None or not text.endswith("\n"):
            return self._inner.write(text)
        self._inner.write("".join(line for line in text.splitlines(keepends=True) if not self._noise.hides(line)))
        return len(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

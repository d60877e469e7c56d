"""Firing docs/reliability.md's operators' faults from the measuring process (tests/testbed/measure_faults.py) at a
step of rank 0, and leaving the bed healed however that process ends: a fault thread is not a daemon (an interpreter
that exits on an error waits for it to end, and a cut-off or a full disk heals in its own ``finally``), a thread that
has not fired yet gives up once the measuring ends, and the end removes any cut-off's nftables table still in place.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from kbit_core.testbed import disk_faults, faults, upgrade

ALL_FAULTS = (*faults.FAULTS, *disk_faults.DISK_FAULTS, upgrade.UPGRADE)
# Set once the measuring ends: a fault thread still waiting for its step gives up instead of firing
MEASURING_ENDED = threading.Event()
# The name of every thread that fires a fault starts so (the measuring's end waits for those alone: a client library's
# idle worker threads never end)
FAULT_THREAD = "fault "


def fire(name: str, brokers: faults.BedBrokers, topic: str, cut_off_s: float) -> faults.FaultReport:
    """Fault ``name`` on the bed, on the leader of ``topic``'s partition 0 where it takes one broker; its report once
    the cluster is whole again."""
    if name == upgrade.UPGRADE:
        return upgrade.rolling_upgrade(Path(brokers.cluster.run_dir).parent)  # the bed's run dir is <bed_dir>/run
    if name == "rolling-restart":
        return faults.rolling_restart(brokers)
    if name == "kill-controller":
        return faults.kill_controller(brokers)
    victim, host = brokers.leader_of(topic, 0)  # the leader of rank 0's first partition
    if name == "fill-disk":  # until Kafka shut that broker down
        return disk_faults.fill_disk(brokers, [victim])
    return faults.cut_off(brokers, victim, host, cut_off_s)


class FaultAtStep(threading.Thread):
    """Fires ``fire(name, brokers, topic, cut_off_s)`` once ``clock`` counts ``step`` steps (0: at once), unless the
    measuring ends first; ``fired_at`` is when it began (Unix time, as the ranks' step clocks), ``report`` its report,
    ``error`` what it raised."""

    def __init__(self, clock: Path, step: int, name: str, brokers: faults.BedBrokers, topic: str, cut_off_s: float):
        super().__init__(name=f"{FAULT_THREAD}{name}")  # not a daemon: see the module's docstring
        self._clock, self._step, self._fault = clock, step, (name, brokers, topic, cut_off_s)
        self.fired_at: float | None = None
        self.report: faults.FaultReport | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        while self._step and (not self._clock.exists() or len(self._clock.read_text().splitlines()) < self._step):
            if MEASURING_ENDED.wait(0.1):
                return
        self.fired_at = time.time()
        try:
            self.report = fire(*self._fault)
        except Exception as exc:  # the row says how the fault failed
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"

    def row(self) -> dict | None:
        """The fault's part of a row, once the thread ended."""
        if self.error:
            return {"error": self.error}
        return self.report.to_dict() | {"fired_at": round(self.fired_at or 0, 2)} if self.report else None


def exit_on_sigterm() -> None:
    """A SIGTERM (``kill``, a job's timeout) ends the measuring as an error does, through every ``finally``."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def end_measuring(brokers: faults.BedBrokers) -> list[str]:
    """Stop every fault thread that has not fired, wait for those that did to end (each heals in its ``finally``),
    then remove any cut-off's nftables table left on a host (a process killed mid-cut); the hosts healed so."""
    MEASURING_ENDED.set()
    deadline = time.monotonic() + faults.WHOLE_AGAIN_S
    for thread in threading.enumerate():
        if thread.name.startswith(FAULT_THREAD) and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    return faults.heal_cut_offs(brokers.hosts)

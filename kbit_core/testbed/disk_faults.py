"""A broker's log directory full, then freed, on the test bed (``kbit cluster fault fill-disk --broker HOST``): its
own small filesystem (:mod:`kbit_core.testbed.log_disks`) filled until Kafka's next write fails with "No space left
on device" and Kafka, its only log directory failed, shuts the broker down; then the space freed, the broker started
again on its data, and the cluster waited for until it is whole again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.testbed import log_disks
from kbit_core.testbed.faults import WHOLE_AGAIN_S, BedBrokers, FaultReport, wait_whole
from kbit_core.testbed.network import TestbedError

DISK_FAULTS = ("fill-disk",)
_POLL_S = 0.25
# Kafka's error as a log directory fails ("Error while appending records to t-0 in dir /x", "Error while writing to
# checkpoint file /x/replication-offset-checkpoint"), logged by this class; its exception is on the next line
_DIR_ERROR = re.compile(r"\] ERROR .*\(org\.apache\.kafka\.storage\.internals\.log\.LogDirFailureChannel\)$")


def shutdown_cause(broker: ApacheKafkaBroker) -> str | None:
    """Why Kafka shut the broker down since its latest start, in one line: its log directory's failure and the
    I/O error behind it, e.g. "Shutdown broker because all log dirs in /x have failed (java.io.IOException: No space
    left on device)"; None when its log says no such thing."""
    lines = broker.log_tail(400).splitlines()
    at = next(
        (i for i in range(len(lines) - 1, -1, -1) if "log dirs in" in lines[i] and "have failed" in lines[i]), None
    )
    if at is None:  # the active controller's metadata log failed first: its raft thread ends the process instead
        at = next((i for i in range(len(lines) - 1, -1, -1) if "Encountered fatal fault" in lines[i]), None)
    if at is None:
        return None
    # the I/O error the log directory failed with: the exception line under the last such error before it
    io_error = next((lines[i + 1].strip() for i in range(at - 1, -1, -1) if _DIR_ERROR.search(lines[i])), None)
    message = lines[at].split(" ERROR ", 1)[-1].rsplit(" (", 1)[0]
    return f"{message} ({io_error})" if io_error else message


@contextmanager
def disks_full(bed: BedBrokers, victims: list[ApacheKafkaBroker], report: FaultReport) -> Iterator[None]:
    """The victims' log filesystems full inside the block, one after the other as disks fill up: each but the last
    shut down by Kafka and fenced by the controller before the next fills (its periodic checkpoint write fails within
    seconds). Afterwards freed, each broker Kafka shut down started again on its data, and the cluster whole again.
    Adds a step per victim to ``report``."""
    for broker in victims:
        log_disks.require_log_disk(broker)
    filled = {}
    try:
        for i, broker in enumerate(victims):
            filled[broker.service.name] = (log_disks.fill(broker), time.monotonic())
            if i < len(victims) - 1:
                if wait_stopped([broker], WHOLE_AGAIN_S) is None:
                    raise TestbedError(
                        f"Kafka kept {broker.service.name} up for {WHOLE_AGAIN_S:.0f}s with its disk full"
                    )
                wait_fenced(bed, broker)
        yield
    finally:
        freed = time.monotonic()
        # Kafka's reason, read before the restart (the broker's log is read from its latest start on)
        causes = {b.service.name: shutdown_cause(b) if b.service.pid() is None else None for b in victims}
        stopped = {broker.service.name: broker.service.pid() is None for broker in victims}
        for broker in victims:
            log_disks.free(broker)
        for broker in victims:
            if stopped[broker.service.name]:
                broker.start(timeout_s=WHOLE_AGAIN_S)
        serving = time.monotonic()
        caught_up = wait_whole(bed.cluster)
        for broker in victims:
            taken, at = filled.get(broker.service.name, (0, freed))
            report.steps.append(
                {
                    "broker": broker.service.name,
                    "filled_mb": round(taken / 2**20, 1),
                    "full_s": round(freed - at, 1),
                    "shut_down_by_kafka": stopped[broker.service.name],
                    "cause": causes[broker.service.name],
                    "restarted_in_s": round(serving - freed, 1),
                    "in_sync_after_s": round(caught_up, 1),
                }
            )


def wait_stopped(victims: list[ApacheKafkaBroker], timeout_s: float) -> float | None:
    """Wait until Kafka has shut every victim down; the seconds that took, or None at the deadline."""
    started = time.monotonic()
    while any(broker.service.pid() is not None for broker in victims):
        if time.monotonic() - started > timeout_s:
            return None
        time.sleep(_POLL_S)
    return time.monotonic() - started


def wait_fenced(bed: BedBrokers, broker: ApacheKafkaBroker, timeout_s: float = WHOLE_AGAIN_S) -> float:
    """Wait until the other brokers' metadata no longer lists ``broker`` (the controller fenced it: its leaderships
    moved, its replicas left the in-sync sets); the seconds that took. TestbedError at the deadline."""
    others = bed.cluster.admin([n for n, b in zip(bed.cluster.nodes, bed.cluster.brokers) if b is not broker])
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if broker.node_id not in others.list_topics(timeout=5).brokers:
                return time.monotonic() - started
        except Exception:  # any client error: no answer this time
            pass
        time.sleep(_POLL_S)
    raise TestbedError(f"the controller did not fence {broker.service.name} within {timeout_s:.0f}s")


def fill_disk(bed: BedBrokers, victims: list[ApacheKafkaBroker], seconds: float = 0.0) -> FaultReport:
    """The victims' log filesystems full for ``seconds`` and until Kafka shut each broker down (its next write past
    its last block fails; at most WHOLE_AGAIN_S), then freed and the brokers back in sync."""
    report = FaultReport("fill-disk")
    started = time.monotonic()
    with disks_full(bed, victims, report):
        stopped_after = wait_stopped(victims, WHOLE_AGAIN_S)
        time.sleep(max(0.0, started + seconds - time.monotonic()))
    for step in report.steps:
        step["all_shut_down_after_s"] = None if stopped_after is None else round(stopped_after, 1)
    report.seconds = time.monotonic() - started
    return report

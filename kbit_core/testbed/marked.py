"""The bed's processes: found by the marker variable each carries (also after a crash, without the state file), each
one's hostname as it sees it, and ended: SIGTERM, then SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from kbit_core.service import pid_alive

# Every process the bed starts carries this variable, so `down` finds them after a crash even
# without the state file (executors inherit it from their worker).
MARKER_ENV = "KBIT_TESTBED"


def marked_processes() -> dict[int, str]:
    """PID -> bed directory of every process carrying the bed's marker variable, except this one."""
    needle = f"{MARKER_ENV}=".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(needle):
                found[int(entry.name)] = var[len(needle) :].decode(errors="replace")
    return found


def marked_pids() -> list[int]:
    return list(marked_processes())


def running_bed_dir() -> Path | None:
    """The directory of the bed whose processes run on this machine (whoever started it), or None."""
    dirs = set(marked_processes().values())
    return Path(dirs.pop()) if len(dirs) == 1 else None


def terminate(pids: Iterable[int], timeout_s: float = 10.0) -> None:
    pids = [p for p in set(pids) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if pid_alive(p)]
        if not pids:
            return
    for pid in pids:  # our own children (tests start the bed in-process) must not stay zombies
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def hostname_of(pid: int) -> str | None:
    """The hostname in the UTS namespace of ``pid`` (what `socket.gethostname()` returns there)."""
    try:
        out = subprocess.run(
            ["nsenter", "--target", str(pid), "--uts", "hostname"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None

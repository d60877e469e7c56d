"""`ray stop` for one host of the test bed: stop the Ray processes started on this host through its sshd, and nothing
else (Ray's own `ray stop` stops every Ray process of the machine, and the bed's hosts share one process table).

Run on a node host as ``python -m kbit_core.testbed.ray_node_stop`` (the host's `ray stop`, see
:mod:`kbit_core.testbed.ssh_hosts`): the processes whose environment names this host and this bed, except this
process and its ancestors (the SSH session running it).
"""

from __future__ import annotations

import os
import sys

import psutil

from kbit_core.testbed.marked import MARKER_ENV
from kbit_core.testbed.ssh_hosts import HOST_VARIABLE


def host_ray_processes(host: str, bed: str) -> list[psutil.Process]:
    """Ray's processes whose environment has ``KBIT_BED_HOST=host`` and the bed's marker ``bed``."""
    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid in own or "ray" not in " ".join(proc.info["cmdline"] or []).lower():
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(HOST_VARIABLE) == host and env.get(MARKER_ENV) == bed:
            found.append(proc)
    return found


def stop(host: str, bed: str, grace_s: float = 10.0) -> int:
    """SIGTERM this host's Ray processes, SIGKILL what is left after ``grace_s``; how many there were."""
    procs = host_ray_processes(host, bed)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


def main() -> int:
    host, bed = os.environ.get(HOST_VARIABLE), os.environ.get(MARKER_ENV)
    if not host or not bed:
        print(f"ray stop (kbit): {HOST_VARIABLE} and {MARKER_ENV} are not set: not on a test bed host", file=sys.stderr)
        return 2
    print(f"ray stop (kbit): stopped {stop(host, bed)} Ray process(es) of {host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

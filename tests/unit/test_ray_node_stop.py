"""The bed hosts' `ray stop`: only the Ray processes of this host of this bed stop (Ray's own stops every Ray process
of the machine, and the bed's hosts share one process table: ray-project/ray#11513)."""

from __future__ import annotations

import os
import subprocess
import sys

from kbit_core.testbed.marked import MARKER_ENV
from kbit_core.testbed.ray_node_stop import stop
from kbit_core.testbed.ssh_hosts import HOST_VARIABLE


def _ray_like(host: str, bed: str) -> subprocess.Popen[bytes]:
    # "ray" in its command line, like raylet, gcs_server and `ray::` workers
    argv = [sys.executable, "-c", "import time; time.sleep(120)", "fake-raylet"]
    return subprocess.Popen(argv, env={**os.environ, HOST_VARIABLE: host, MARKER_ENV: bed})


def test_stop_ends_this_hosts_ray_processes_of_this_bed_only(tmp_path):
    bed = str(tmp_path / "testbed")
    mine, other_host, other_bed = _ray_like("node1", bed), _ray_like("node2", bed), _ray_like("node1", "/elsewhere")
    try:
        assert stop("node1", bed, grace_s=30) == 1
        assert mine.wait(timeout=30) is not None
        assert other_host.poll() is None and other_bed.poll() is None
    finally:
        for proc in (mine, other_host, other_bed):
            proc.kill()
            proc.wait()

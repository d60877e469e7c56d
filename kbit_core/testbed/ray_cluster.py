"""Ray on the test bed (the `ray` extra): a Ray node on every node host, the head on the first, one CPU each.

No Ray process runs on the driver host. Ray 2.60's gRPC servers (GCS, raylet, workers) listen either on 127.0.0.1
(a node address of 127.0.0.1) or on every interface: a head on the driver's bridge address would listen on the
machine's own interfaces too. Inside a node's namespace every interface is the bed's. The driver joins through Ray
Client (``ray://<node1>:<client port>``), which needs no raylet on the driver's host, unlike a plain driver.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kbit_core import ray_env
from kbit_core.service import Service
from kbit_core.testbed.network import Host, TestbedError, in_host

MARKER = "ray.scripts.scripts"
_ALIVE_NODES = (
    "import json, sys\nfrom ray._raylet import GcsClient\n"
    "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5).values()\n"
    "print(json.dumps(sorted(n.node_manager_address for n in nodes if n.state == 0)))"
)


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def _ray_start(*args: str) -> list[str]:
    return [sys.executable, "-m", MARKER, "start", "--block", "--disable-usage-stats", *args]


def _bed_env(token_file: Path) -> dict[str, str]:
    # Cluster mode is said explicitly: the bed's nodes join a head on another host, and a process that has started a
    # local Ray runtime carries the local setting in its own environment.
    return ray_env.ray_env(token_file, loopback=False)


def head_service(
    run_dir: Path,
    node: Host,
    port: int,
    client_port: int,
    cpus: int,
    object_store_mb: int,
    marker_env: dict[str, str],
    token_file: Path,
) -> Service:
    """The bed's Ray head; it creates the bed's token (``token_file``) as it starts."""
    argv = in_host(
        node,
        _ray_start(
            "--head",
            f"--node-ip-address={node.address}",
            f"--port={port}",
            f"--ray-client-server-port={client_port}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={object_store_mb * 2**20}",
            "--include-dashboard=false",
        ),
    )
    return Service(
        f"ray-head-{node.name}",
        run_dir,
        argv,
        marker=MARKER,
        env={**marker_env, **_bed_env(token_file), **ray_env.HEAD_ENV},
        prepare=lambda: ray_env.create_token(token_file),
        host=node.address,
        port=port,
        ready_ports=(client_port,),
        url=f"ray://{node.address}:{client_port}",
        error_type=TestbedError,
    )


def worker_service(
    run_dir: Path,
    node: Host,
    head_address: str,
    cpus: int,
    object_store_mb: int,
    marker_env: dict[str, str],
    token_file: Path,
) -> Service:
    argv = in_host(
        node,
        _ray_start(
            f"--address={head_address}",
            f"--node-ip-address={node.address}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={object_store_mb * 2**20}",
        ),
    )
    return Service(
        f"ray-worker-{node.name}",
        run_dir,
        argv,
        marker=MARKER,
        env={**marker_env, **_bed_env(token_file), **ray_env.NODE_ENV},
        host=node.address,
        error_type=TestbedError,
    )


def alive_nodes(head_address: str, token_file: Path) -> list[str]:
    """Addresses of the nodes the head's GCS counts ALIVE (empty when it does not answer)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ALIVE_NODES, head_address],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **_bed_env(token_file)},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return []
    return json.loads(done.stdout) if done.returncode == 0 else []


def wait_for_nodes(
    head_address: str, token_file: Path, addresses: list[str], timeout_s: float, services: list[Service]
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if set(addresses) <= set(alive_nodes(head_address, token_file)):
            return
        time.sleep(1.0)
    missing = sorted(set(addresses) - set(alive_nodes(head_address, token_file)))
    tails = "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail()}" for s in services if (s.host or "") in missing)
    raise TestbedError(
        f"the Ray head at {head_address} does not count the nodes on {', '.join(missing)} as ALIVE "
        f"within {timeout_s:.0f}s:\n{tails}"
    )

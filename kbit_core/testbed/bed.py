"""The multi-host test bed: bring the network, the TLS broker and the Spark standalone cluster up and down as one unit.

`up` writes ``<bed_dir>/state.json`` (a :class:`BedState`); everything a client needs to reach the bed
(master URL, broker bootstrap, CA and client certificate) is read from there, never guessed.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kbit_core import ray_env
from kbit_core.kafka.broker import EmbeddedBroker
from kbit_core.service import Service, pid_alive
from kbit_core.testbed import network, ray_cluster
from kbit_core.testbed.certs import certificate_paths, make_certificates
from kbit_core.testbed.network import Host, TestbedError, Topology
from kbit_core.testbed.spark_standalone import (
    alive_workers,
    java_missing,
    master_service,
    spark_home,
    wait_for_workers,
    worker_service,
)

DEFAULT_SUBNET = "10.213.7.0/24"
# Every process the bed starts carries this variable, so `down` finds them after a crash even
# without the state file (executors inherit it from their worker).
MARKER_ENV = "KBIT_TESTBED"
NOT_UP = "the multi-host test bed is not up; run `kbit cluster up`"


@dataclass(frozen=True)
class BedOptions:
    subnet: str = DEFAULT_SUBNET
    nodes: int = 2
    master_port: int = 7077
    master_webui_port: int = 8680
    worker_port: int = 7078
    worker_webui_port: int = 8681
    worker_cores: int = 1
    worker_memory: str = "2g"
    broker_port: int = 19093
    broker_plain_port: int = 19193  # Tansu itself, on the driver's loopback: only the TLS front reaches it
    client_auth: bool = True        # mutual TLS: the broker refuses clients without a certificate from the bed's CA
    ray: bool = field(default_factory=ray_cluster.ray_installed)  # Ray nodes on the node hosts (the `ray` extra)
    ray_head_port: int = 6380
    ray_client_port: int = 10001
    ray_object_store_mb: int = 256


class BedHost(BaseModel):
    name: str
    address: str
    netns: str | None


class BedState(BaseModel):
    """What `up` made: the file the CLI, the tests and kbit configs read to reach the bed."""

    bed_dir: Path
    subnet: str
    driver: BedHost
    nodes: list[BedHost]
    master_url: str
    master_webui: str
    broker_bootstrap: str
    security_protocol: str = "SSL"
    ssl_cafile: Path
    ssl_certfile: Path | None
    ssl_keyfile: Path | None
    ray_address: str | None = None  # Ray Client's address on the first node host; None: the bed runs no Ray
    options: dict[str, Any]

    def kafka_overrides(self) -> dict[str, str]:
        """Dotted kbit config overrides that point the Kafka clients at the bed's TLS broker."""
        over = {"kafka.bootstrap_servers": self.broker_bootstrap, "kafka.broker_kind": "tansu",  # behind the TLS front
                "kafka.security_protocol": self.security_protocol,
                "kafka.ssl_cafile": str(self.ssl_cafile)}
        if self.ssl_certfile and self.ssl_keyfile:
            over |= {"kafka.ssl_certfile": str(self.ssl_certfile), "kafka.ssl_keyfile": str(self.ssl_keyfile)}
        return over

    def ray_overrides(self) -> dict[str, str]:
        """Dotted kbit config overrides that run the ranks on the bed's Ray nodes, with the bed's Ray token."""
        if self.ray_address is None:
            raise TestbedError("this test bed runs no Ray (the `ray` extra was not installed when it came up)")
        return {"launch.engine": "ray", "launch.ray_address": self.ray_address,
                "launch.ray_auth_token_file": str(ray_env.own_token_file(self.bed_dir))}


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    host: str
    address: str
    pid: int | None
    alive: bool
    hostname: str | None  # what the process itself sees as its hostname
    log: str


@dataclass
class BedStatus:
    up: bool
    state: BedState | None
    processes: list[ProcessStatus] = field(default_factory=list)
    alive_workers: list[str] = field(default_factory=list)
    ray_nodes: list[str] = field(default_factory=list)
    bridge: bool = False
    namespaces: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"up": self.up, "state": self.state.model_dump(mode="json") if self.state else None,
                "processes": [asdict(p) for p in self.processes], "alive_workers": self.alive_workers,
                "ray_nodes": self.ray_nodes, "bridge": self.bridge, "namespaces": self.namespaces}


def state_path(bed_dir: Path) -> Path:
    return Path(bed_dir) / "state.json"


def load_state(bed_dir: Path) -> BedState | None:
    """The state `up` wrote, or None when the bed was never brought up here (or `down` removed it)."""
    try:
        return BedState.model_validate_json(state_path(bed_dir).read_text())
    except (OSError, ValueError):
        return None


def missing_prerequisites() -> list[str]:
    missing = network.missing_prerequisites()
    if not missing:
        missing += [] if shutil.which("openssl") else ["the `openssl` command (for the bed's certificates)"]
        missing += [m for m in [java_missing()] if m]
        try:
            spark_home()
        except TestbedError as exc:
            missing.append(str(exc))
    return missing


def _check_prerequisites() -> None:
    missing = missing_prerequisites()
    if missing:
        raise TestbedError("the multi-host test bed cannot run on this machine; missing: " + "; ".join(missing))


class _Processes:
    """The bed's processes (as Services) for a bed directory and options; used by up, status and down alike."""

    def __init__(self, bed_dir: Path, options: BedOptions) -> None:
        self.topology = Topology.build(options.subnet, options.nodes)
        run_dir = Path(bed_dir).resolve() / "run"
        marker = {MARKER_ENV: str(Path(bed_dir).resolve())}
        driver = self.topology.driver
        self.bootstrap = f"{driver.address}:{options.broker_port}"
        self.broker = EmbeddedBroker(run_dir, "127.0.0.1", options.broker_plain_port, advertised=self.bootstrap,
                                     env=marker)
        certs = certificate_paths(Path(bed_dir).resolve() / "certs")
        tls_argv = [sys.executable, "-m", "kbit_core.testbed.tls_front", "--listen", self.bootstrap,
                    "--upstream", self.broker.bootstrap, "--cert", str(certs.server_cert),
                    "--key", str(certs.server_key)]
        if options.client_auth:
            tls_argv += ["--client-ca", str(certs.ca)]
        self.tls_front = Service("broker-tls", run_dir, tls_argv, marker="kbit_core.testbed.tls_front", env=marker,
                                 host=driver.address, port=options.broker_port, url=self.bootstrap,
                                 error_type=TestbedError)
        self.master = master_service(run_dir, driver, options.master_port, options.master_webui_port, marker)
        self.workers = [worker_service(run_dir, node, self.master.url or "", options.worker_port,
                                       options.worker_webui_port, options.worker_cores, options.worker_memory, marker)
                        for node in self.topology.nodes]
        head_node, *worker_nodes = self.topology.nodes
        self.ray_head_address = f"{head_node.address}:{options.ray_head_port}"
        self.ray_nodes: list[Service] = []  # the head first, then a worker per further node
        self.ray_token = ray_env.own_token_file(Path(bed_dir).resolve())
        if options.ray:
            self.ray_nodes = [
                ray_cluster.head_service(run_dir, head_node, options.ray_head_port, options.ray_client_port,
                                         options.worker_cores, options.ray_object_store_mb, marker, self.ray_token),
                *[ray_cluster.worker_service(run_dir, node, self.ray_head_address, options.worker_cores,
                                             options.ray_object_store_mb, marker, self.ray_token)
                  for node in worker_nodes]]

    def all(self) -> list[tuple[Service, Host]]:
        driver = self.topology.driver
        return [(self.broker.service, driver), (self.tls_front, driver), (self.master, driver),
                *zip(self.workers, self.topology.nodes), *zip(self.ray_nodes, self.topology.nodes)]


def up(bed_dir: Path, options: BedOptions = BedOptions(), timeout_s: float = 180.0) -> BedState:
    """Create the network, certificates, TLS broker, Spark master and workers; wait until all are healthy.

    Returns the running bed's state unchanged when it is already up; a half-made or crashed bed is
    removed first. On failure everything made so far is removed and the error carries the log tail.
    """
    _check_prerequisites()
    bed_dir = Path(bed_dir).resolve()
    current = status(bed_dir)
    if current.up and current.state is not None:
        return current.state
    other = running_bed_dir()
    if other is not None and other != bed_dir and status(other).up:
        raise TestbedError(f"a test bed from {other} is already up (there is one per machine); use it, or stop it "
                           "with `kbit cluster down` first")
    if current.state is not None or current.bridge or current.namespaces or _marked_pids():
        down(bed_dir)
    procs = _Processes(bed_dir, options)
    topo = procs.topology
    try:
        network.create(topo)
        certs = make_certificates(bed_dir / "certs", topo.driver.address, [topo.driver.name, socket.gethostname()])
        procs.broker.start()
        procs.tls_front.start(timeout_s=30)
        procs.master.start(timeout_s=timeout_s)
        with ThreadPoolExecutor(len(procs.workers)) as pool:
            list(pool.map(lambda w: w.start(timeout_s=timeout_s), procs.workers))
        wait_for_workers(topo.driver.address, options.master_webui_port, [n.address for n in topo.nodes],
                         timeout_s, procs.workers)
        if procs.ray_nodes:
            ray_head, *ray_workers = procs.ray_nodes
            ray_head.start(timeout_s=timeout_s)
            with ThreadPoolExecutor(max(len(ray_workers), 1)) as pool:
                list(pool.map(lambda w: w.start(timeout_s=timeout_s), ray_workers))
            ray_cluster.wait_for_nodes(procs.ray_head_address, procs.ray_token, [n.address for n in topo.nodes],
                                       timeout_s, procs.ray_nodes)
        state = BedState(
            bed_dir=bed_dir, subnet=str(topo.subnet),
            driver=BedHost(name=topo.driver.name, address=topo.driver.address, netns=None),
            nodes=[BedHost(name=n.name, address=n.address, netns=n.netns) for n in topo.nodes],
            master_url=procs.master.url or "", master_webui=f"http://{topo.driver.address}:{options.master_webui_port}",
            broker_bootstrap=procs.bootstrap, ssl_cafile=certs.ca,
            ssl_certfile=certs.client_cert if options.client_auth else None,
            ssl_keyfile=certs.client_key if options.client_auth else None,
            ray_address=procs.ray_nodes[0].url if procs.ray_nodes else None, options=asdict(options))
        _probe_broker(state, procs)
    except BaseException:
        down(bed_dir)
        raise
    state_path(bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def _probe_broker(state: BedState, procs: _Processes, timeout_s: float = 15.0) -> None:
    """A metadata request over TLS, with the bed's CA and client certificate, must list the broker."""
    from confluent_kafka.admin import AdminClient

    from kbit_core.config import KafkaConfig
    from kbit_core.kafka.settings import confluent_options

    kafka = KafkaConfig.model_validate({k.removeprefix("kafka."): v for k, v in state.kafka_overrides().items()})
    try:
        AdminClient({**confluent_options(kafka), "log_level": 0}).list_topics(timeout=timeout_s)
    except Exception as exc:
        raise TestbedError(f"the broker at {state.broker_bootstrap} does not answer a TLS metadata request: {exc}\n"
                           f"--- broker-tls ({procs.tls_front.log_path}):\n{procs.tls_front.log_tail()}\n"
                           f"--- broker ({procs.broker.log_path}):\n{procs.broker.service.log_tail()}") from None


def _hostname_of(pid: int) -> str | None:
    """The hostname in the UTS namespace of ``pid`` (what `socket.gethostname()` returns there)."""
    try:
        out = subprocess.run(["nsenter", "--target", str(pid), "--uts", "hostname"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def status(bed_dir: Path) -> BedStatus:
    """Each process (alive? its hostname), the workers the master sees ALIVE, and what of the network exists."""
    bed_dir = Path(bed_dir).resolve()
    state = load_state(bed_dir)
    result = BedStatus(up=False, state=state, bridge=network.bridge_exists(), namespaces=network.bed_namespaces())
    if state is None:
        return result
    options = BedOptions(**state.options)
    procs = _Processes(bed_dir, options)
    for service, host in procs.all():
        pid = service.pid()
        result.processes.append(ProcessStatus(service.name, host.name, host.address, pid, pid is not None,
                                              _hostname_of(pid) if pid else None, str(service.log_path)))
    workers = alive_workers(state.driver.address, options.master_webui_port) if result.bridge else {}
    result.alive_workers = sorted(workers)
    if procs.ray_nodes and result.bridge:
        result.ray_nodes = ray_cluster.alive_nodes(procs.ray_head_address, procs.ray_token)
    result.up = (result.bridge and all(p.alive for p in result.processes)
                 and {n.address for n in state.nodes} <= set(workers)
                 and (not procs.ray_nodes or {n.address for n in state.nodes} <= set(result.ray_nodes)))
    return result


def _marked_processes() -> dict[int, str]:
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
                found[int(entry.name)] = var[len(needle):].decode(errors="replace")
    return found


def _marked_pids() -> list[int]:
    return list(_marked_processes())


def running_bed_dir() -> Path | None:
    """The directory of the bed whose processes run on this machine (whoever started it), or None."""
    dirs = set(_marked_processes().values())
    return Path(dirs.pop()) if len(dirs) == 1 else None


def _terminate(pids: Iterable[int], timeout_s: float = 10.0) -> None:
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


def down(bed_dir: Path | None = None) -> list[str]:
    """Stop every process and remove every namespace and link the bed made; also after a crash. Idempotent.

    Processes are found three ways: the PID files under ``bed_dir`` (a clean stop), the processes
    inside the bed's namespaces, and any process carrying the bed's marker variable.
    """
    removed: list[str] = []
    state = load_state(bed_dir) if bed_dir is not None else None
    if state is not None:
        for service, _host in _Processes(Path(bed_dir), BedOptions(**state.options)).all():
            if service.stop(timeout_s=10):
                removed.append(f"process {service.name}")
    leftovers = _marked_pids() + [pid for ns in network.bed_namespaces() for pid in network.namespace_pids(ns)]
    if leftovers:
        _terminate(leftovers)
        removed.append(f"{len(set(leftovers))} leftover process(es)")
    removed += network.destroy()
    if bed_dir is not None:
        state_path(bed_dir).unlink(missing_ok=True)
    return removed


def require_bed_for(addresses: Iterable[str | None], subnet: str = DEFAULT_SUBNET) -> None:
    """Refuse to connect to a bed address (e.g. ``spark://10.213.7.1:7077``, a bootstrap list) while the bed is down.

    Without the bridge, traffic to the bed's subnet would follow the machine's default route out.
    """
    bed_nets = [ipaddress.IPv4Network(subnet)]
    up_nets = network.bridge_networks()
    for address in addresses:
        for ip in _ips_in(address or ""):
            if any(ip in n for n in bed_nets + up_nets) and not any(ip in n for n in up_nets):
                raise TestbedError(f"{address!r} is on the test bed's network ({subnet}), but {NOT_UP}")


def _ips_in(address: str) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses in 'host:port', 'scheme://host:port' or a comma-separated list of them."""
    ips = []
    for part in address.split(","):
        host = part.strip().split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        try:
            ips.append(ipaddress.IPv4Address(host))
        except ValueError:
            continue
    return ips

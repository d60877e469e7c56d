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
from dataclasses import asdict
from pathlib import Path

from confluent_kafka.admin import AdminClient

from kbit_core import ray_env
from kbit_core.config import KafkaConfig
from kbit_core.kafka.broker import EmbeddedBroker
from kbit_core.kafka.settings import confluent_options
from kbit_core.service import Service, pid_alive
from kbit_core.testbed import network, ray_cluster, shaping
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
from kbit_core.testbed.state import (
    DEFAULT_SUBNET,
    BedHost,
    BedOptions,
    BedState,
    BedStatus,
    ProcessStatus,
    load_state,
    state_path,
)

# Every process the bed starts carries this variable, so `down` finds them after a crash even
# without the state file (executors inherit it from their worker).
MARKER_ENV = "KBIT_TESTBED"
NOT_UP = "the multi-host test bed is not up; run `kbit cluster up`"


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


def _check_prerequisites(options: BedOptions) -> None:
    missing = missing_prerequisites() + (shaping.missing_prerequisites() if options.link else [])
    if missing:
        raise TestbedError("the multi-host test bed cannot run on this machine; missing: " + "; ".join(missing))


def _tls_front(
    bed_dir: Path,
    run_dir: Path,
    driver: Host,
    bootstrap: str,
    upstream: str,
    options: BedOptions,
    marker: dict[str, str],
) -> Service:
    """TLS in front of the broker at ``bootstrap`` on the driver host (client certificates required with
    ``client_auth``), relaying to the broker's plain listener ``upstream``."""
    certs = certificate_paths(bed_dir / "certs")
    argv = [
        sys.executable,
        "-m",
        "kbit_core.testbed.tls_front",
        "--listen",
        bootstrap,
        "--upstream",
        upstream,
        "--cert",
        str(certs.server_cert),
        "--key",
        str(certs.server_key),
    ]
    if options.client_auth:
        argv += ["--client-ca", str(certs.ca)]
    return Service(
        "broker-tls",
        run_dir,
        argv,
        marker="kbit_core.testbed.tls_front",
        env=marker,
        host=driver.address,
        port=options.broker_port,
        url=bootstrap,
        error_type=TestbedError,
    )


class _Processes:
    """The bed's processes (as Services) for a bed directory and options; used by up, status and down alike."""

    def __init__(self, bed_dir: Path, options: BedOptions) -> None:
        self.topology = Topology.build(options.subnet, options.nodes)
        run_dir = Path(bed_dir).resolve() / "run"
        marker = {MARKER_ENV: str(Path(bed_dir).resolve())}
        driver = self.topology.driver
        self.bootstrap = f"{driver.address}:{options.broker_port}"
        self.broker = EmbeddedBroker(
            run_dir, "127.0.0.1", options.broker_plain_port, advertised=self.bootstrap, env=marker
        )
        self.tls_front = _tls_front(
            Path(bed_dir).resolve(), run_dir, driver, self.bootstrap, self.broker.bootstrap, options, marker
        )
        self.master = master_service(run_dir, driver, options.master_port, options.master_webui_port, marker)
        self.workers = [
            worker_service(
                run_dir,
                node,
                self.master.url or "",
                options.worker_port,
                options.worker_webui_port,
                options.worker_cores,
                options.worker_memory,
                marker,
            )
            for node in self.topology.nodes
        ]
        self.delay_relays = shaping.delay_relays(run_dir, self.topology.nodes, options, marker)
        head_node, *worker_nodes = self.topology.nodes
        self.ray_head_address = f"{head_node.address}:{options.ray_head_port}"
        self.ray_token = ray_env.own_token_file(Path(bed_dir).resolve())
        # the head first, then a worker per further node
        self.ray_nodes: list[Service] = (
            [
                ray_cluster.head_service(
                    run_dir,
                    head_node,
                    options.ray_head_port,
                    options.ray_client_port,
                    options.worker_cores,
                    options.ray_object_store_mb,
                    marker,
                    self.ray_token,
                ),
                *[
                    ray_cluster.worker_service(
                        run_dir,
                        node,
                        self.ray_head_address,
                        options.worker_cores,
                        options.ray_object_store_mb,
                        marker,
                        self.ray_token,
                    )
                    for node in worker_nodes
                ],
            ]
            if options.ray
            else []
        )

    def all(self) -> list[tuple[Service, Host]]:
        driver = self.topology.driver
        return [
            (self.broker.service, driver),
            (self.tls_front, driver),
            (self.master, driver),
            *zip(self.workers, self.topology.nodes),
            *zip(self.ray_nodes, self.topology.nodes),
            *zip(self.delay_relays, self.topology.nodes),
        ]


def up(bed_dir: Path, options: BedOptions = BedOptions(), timeout_s: float = 180.0) -> BedState:
    """Create the network, certificates, TLS broker, Spark master and workers; wait until all are healthy.

    Returns the running bed's state unchanged when it is already up; a half-made or crashed bed is
    removed first. On failure everything made so far is removed and the error carries the log tail.
    """
    shape = shaping.LinkShape.parse(options.link) if options.link else None
    _check_prerequisites(options)
    bed_dir = Path(bed_dir).resolve()
    current = status(bed_dir)
    if current.up and current.state is not None:
        return current.state
    other = running_bed_dir()
    if other is not None and other != bed_dir and status(other).up:
        raise TestbedError(
            f"a test bed from {other} is already up (there is one per machine); use it, or stop it "
            "with `kbit cluster down` first"
        )
    if current.state is not None or current.bridge or current.namespaces or _marked_pids():
        down(bed_dir)
    procs = _Processes(bed_dir, options)
    topo = procs.topology
    try:
        network.create(topo)
        if shape is not None:
            links = [shaping.link_ends(n) for n in topo.nodes]
            shaping.shape_links(links, shape, procs.delay_relays, options.delay_relay_port)
        certs = make_certificates(bed_dir / "certs", topo.driver.address, [topo.driver.name, socket.gethostname()])
        procs.broker.start()
        procs.tls_front.start(timeout_s=30)
        procs.master.start(timeout_s=timeout_s)
        with ThreadPoolExecutor(len(procs.workers)) as pool:
            list(pool.map(lambda w: w.start(timeout_s=timeout_s), procs.workers))
        wait_for_workers(
            topo.driver.address, options.master_webui_port, [n.address for n in topo.nodes], timeout_s, procs.workers
        )
        if procs.ray_nodes:
            _start_ray(procs, timeout_s)
        state = BedState(
            bed_dir=bed_dir,
            subnet=str(topo.subnet),
            driver=BedHost(name=topo.driver.name, address=topo.driver.address, netns=None),
            nodes=[BedHost(name=n.name, address=n.address, netns=n.netns) for n in topo.nodes],
            master_url=procs.master.url or "",
            master_webui=f"http://{topo.driver.address}:{options.master_webui_port}",
            broker_bootstrap=procs.bootstrap,
            ssl_cafile=certs.ca,
            ssl_certfile=certs.client_cert if options.client_auth else None,
            ssl_keyfile=certs.client_key if options.client_auth else None,
            ray_address=procs.ray_nodes[0].url if procs.ray_nodes else None,
            options=asdict(options),
        )
        _probe_broker(state, procs)
    except BaseException:
        down(bed_dir)
        raise
    state_path(bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def _start_ray(procs: _Processes, timeout_s: float) -> None:
    """The Ray head, then the other nodes together; wait until every node host has joined."""
    ray_head, *ray_workers = procs.ray_nodes
    ray_head.start(timeout_s=timeout_s)
    with ThreadPoolExecutor(max(len(ray_workers), 1)) as pool:
        list(pool.map(lambda w: w.start(timeout_s=timeout_s), ray_workers))
    ray_cluster.wait_for_nodes(
        procs.ray_head_address, procs.ray_token, [n.address for n in procs.topology.nodes], timeout_s, procs.ray_nodes
    )


def _probe_broker(state: BedState, procs: _Processes, timeout_s: float = 15.0) -> None:
    """A metadata request over TLS, with the bed's CA and client certificate, must list the broker."""
    kafka = KafkaConfig.model_validate({k.removeprefix("kafka."): v for k, v in state.kafka_overrides().items()})
    try:
        AdminClient({**confluent_options(kafka), "log_level": 0}).list_topics(timeout=timeout_s)
    except Exception as exc:
        raise TestbedError(
            f"the broker at {state.broker_bootstrap} does not answer a TLS metadata request: {exc}\n"
            f"--- broker-tls ({procs.tls_front.log_path}):\n{procs.tls_front.log_tail()}\n"
            f"--- broker ({procs.broker.log_path}):\n{procs.broker.service.log_tail()}"
        ) from None


def _hostname_of(pid: int) -> str | None:
    """The hostname in the UTS namespace of ``pid`` (what `socket.gethostname()` returns there)."""
    try:
        out = subprocess.run(
            ["nsenter", "--target", str(pid), "--uts", "hostname"], capture_output=True, text=True, timeout=5
        )
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
        result.processes.append(
            ProcessStatus(
                service.name,
                host.name,
                host.address,
                pid,
                pid is not None,
                _hostname_of(pid) if pid else None,
                str(service.log_path),
            )
        )
    workers = alive_workers(state.driver.address, options.master_webui_port) if result.bridge else {}
    if result.bridge:
        result.links = {n.name: shaping.link_in_force(*shaping.link_ends(n)) for n in procs.topology.nodes}
    result.alive_workers = sorted(workers)
    if procs.ray_nodes and result.bridge:
        result.ray_nodes = ray_cluster.alive_nodes(procs.ray_head_address, procs.ray_token)
    result.up = (
        result.bridge
        and all(p.alive for p in result.processes)
        and {n.address for n in state.nodes} <= set(workers)
        and (not procs.ray_nodes or {n.address for n in state.nodes} <= set(result.ray_nodes))
    )
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
                found[int(entry.name)] = var[len(needle) :].decode(errors="replace")
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
    removed += shaping.remove_loss_tables("kbit-")  # the root-side veth ends are kbit-<node> (Host.veth)
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

"""The multi-host test bed: bring the network, the Apache Kafka cluster (a broker on every host, TLS and SCRAM) and
the Spark standalone cluster (and Ray) up and down as one unit.

`up` writes ``<bed_dir>/state.json`` (a :class:`BedState`); everything a client needs to reach the bed
(master URL, broker bootstrap, CA, client certificate, SCRAM user and password file) is read from there, never guessed.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from confluent_kafka.admin import AdminClient

from kbit_core import ray_env
from kbit_core.brokers.apache_broker import kafka_libs
from kbit_core.errors import BrokerError
from kbit_core.kafka.settings import confluent_options
from kbit_core.service import Service
from kbit_core.testbed import log_disks, network, ray_cluster, ray_launcher, shaping, ssh_hosts
from kbit_core.testbed.bed_processes import BedProcesses
from kbit_core.testbed.certs import BedCertificates, make_certificates
from kbit_core.testbed.kafka_bed import TRAIN_USER, create_users_and_acls, password_path
from kbit_core.testbed.marked import hostname_of, marked_pids, running_bed_dir, terminate
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.spark_standalone import (
    alive_workers,
    java_missing,
    spark_home,
    wait_for_workers,
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

NOT_UP = "the multi-host test bed is not up; run `kbit cluster up`"


def missing_prerequisites() -> list[str]:
    missing = network.missing_prerequisites()
    if not missing:
        missing += [] if shutil.which("openssl") else ["the `openssl` command (for the bed's certificates)"]
        missing += [m for m in [java_missing()] if m]
        try:
            kafka_libs()
        except BrokerError as exc:
            missing.append(str(exc))
        try:
            spark_home()
        except TestbedError as exc:
            missing.append(str(exc))
    return missing


def _check_prerequisites(options: BedOptions) -> None:
    missing = missing_prerequisites() + (shaping.missing_prerequisites() if options.link else [])
    if options.kafka_version and not missing:
        try:
            kafka_libs(options.kafka_version)
        except BrokerError as exc:
            missing.append(str(exc))
    if missing:
        raise TestbedError("the multi-host test bed cannot run on this machine; missing: " + "; ".join(missing))


def _bed_state(
    bed_dir: Path, procs: BedProcesses, certs: BedCertificates, kafka_up_s: float, registry_up_s: float | None
) -> BedState:
    """What a running bed's clients need: addresses, the brokers' bootstrap and credentials, Spark and Ray."""
    topo, options = procs.topology, procs.options
    return BedState(
        bed_dir=bed_dir,
        subnet=str(topo.subnet),
        driver=BedHost(name=topo.driver.name, address=topo.driver.address, netns=None),
        nodes=[BedHost(name=n.name, address=n.address, netns=n.netns) for n in topo.nodes],
        master_url=procs.master.url or "",
        master_webui=f"http://{topo.driver.address}:{options.master_webui_port}",
        broker_bootstrap=procs.kafka.bootstrap,
        broker_up_s=round(kafka_up_s, 1),
        sasl_username=TRAIN_USER,
        sasl_password_file=password_path(bed_dir, TRAIN_USER),
        ssl_cafile=certs.ca,
        ssl_certfile=certs.client_cert if options.client_auth else None,
        ssl_keyfile=certs.client_key if options.client_auth else None,
        ray_address=procs.ray_nodes[0].url if procs.ray_nodes else None,
        registry_url=procs.registry.url if procs.registry else None,
        registry_up_s=registry_up_s,
        ray_cluster_yaml=ray_launcher.cluster_yaml_path(bed_dir) if procs.sshds else None,
        options=asdict(options),
    )


def up(bed_dir: Path, options: BedOptions = BedOptions(), timeout_s: float = 180.0) -> BedState:
    """Create the network (shaped with ``options.link``), certificates, Kafka brokers, Spark master and workers; wait
    until all are healthy.

    Returns the running bed's state unchanged when it is already up; a half-made or crashed bed is
    removed first. On failure everything made so far is removed and the error carries the log tail.
    """
    shape = shaping.LinkShape.parse(options.link) if options.link else None
    _check_prerequisites(options)
    bed_dir = Path(bed_dir).resolve()
    current = status(bed_dir)
    if current.up and current.state is not None:
        return start_registry(bed_dir) if options.registry else current.state
    other = running_bed_dir()
    if other is not None and other != bed_dir and status(other).up:
        raise TestbedError(
            f"a test bed from {other} is already up (there is one per machine); use it, or stop it "
            "with `kbit cluster down` first"
        )
    if current.state is not None or current.bridge or current.namespaces or _leftover_processes_or_disks():
        down(bed_dir)
    procs = BedProcesses(bed_dir, options)
    topo = procs.topology
    try:
        network.create(topo)
        if shape is not None:
            links = [shaping.link_ends(n) for n in topo.nodes]
            shaping.shape_links(links, shape, procs.delay_relays, options.delay_relay_port)
        certs = make_certificates(
            bed_dir / "certs", [h.address for h in topo.hosts], [*(h.name for h in topo.hosts), socket.gethostname()]
        )
        if options.log_disk_mb:
            log_disks.mount_log_disks(procs.kafka.brokers, options.log_disk_mb)
        kafka_up_s = _start_kafka(procs, bed_dir, timeout_s)
        with ThreadPoolExecutor(1) as beside:  # the registry's JVM starts while Spark's do
            registry = beside.submit(_start_registry, procs, timeout_s)
            procs.master.start(timeout_s=timeout_s)
            with ThreadPoolExecutor(len(procs.workers)) as pool:
                list(pool.map(lambda w: w.start(timeout_s=timeout_s), procs.workers))
            wait_for_workers(
                topo.driver.address,
                options.master_webui_port,
                [n.address for n in topo.nodes],
                timeout_s,
                procs.workers,
            )
            registry_up_s = registry.result()
        if procs.ray_nodes:
            _start_ray(procs, timeout_s)
        if procs.sshds:  # for Ray's own launcher: `ray up` with the cluster.yaml rendered here
            ssh_hosts.start(bed_dir, procs.sshds, timeout_s)
            ray_launcher.render(bed_dir, topo, ray_env.create_token(procs.ray_token))
        state = _bed_state(bed_dir, procs, certs, kafka_up_s, registry_up_s)
        _probe_broker(state, procs)
    except BaseException:
        down(bed_dir)
        raise
    state_path(bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def _leftover_processes_or_disks() -> bool:
    return bool(marked_pids() or log_disks.log_disk_mounts())


def reshape(bed_dir: Path, link: str | None) -> BedState:
    """Shape the running bed's links to ``link`` (``--link``'s text; None: unshaped) without restarting it.

    The delay relays of the old shape stop (connections through them break: clients reconnect, Kafka's do) and
    those of the new one start; a connection made before a delay was set stays undelayed (the redirect applies
    to new connections), so callers that measure open their connections afterwards. The state file records the
    shape, so `status` and `down` see what is in force.
    """
    bed_dir = Path(bed_dir).resolve()
    state = load_state(bed_dir)
    if state is None:
        raise TestbedError(f"no test bed is up at {bed_dir}: `kbit cluster up` first")
    old = BedOptions(**state.options)
    options = replace(old, link=link)
    shape = shaping.LinkShape.parse(link) if link else None
    _check_prerequisites(options)
    for relay in BedProcesses(bed_dir, old).delay_relays:
        relay.stop()
    procs = BedProcesses(bed_dir, options)
    links = [shaping.link_ends(n) for n in procs.topology.nodes]
    for ends in links:
        for end in ends:
            shaping.clear_end(end)
    if shape is not None:
        shaping.shape_links(links, shape, procs.delay_relays, options.delay_relay_port)
    state = state.model_copy(update={"options": asdict(options)})
    state_path(bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def _start_kafka(procs: BedProcesses, bed_dir: Path, timeout_s: float) -> float:
    """The brokers, then the SCRAM users and ACLs; the seconds that took."""
    started = time.monotonic()
    procs.kafka.start(timeout_s=max(timeout_s, 240.0))
    create_users_and_acls(procs.kafka, bed_dir)
    return time.monotonic() - started


def _start_registry(procs: BedProcesses, timeout_s: float) -> float | None:
    """The Schema Registry on the driver host, when the options ask for it; the seconds its start took."""
    if procs.registry is None:
        return None
    started = time.monotonic()
    procs.registry.start(timeout_s=max(timeout_s, 180.0))
    return round(time.monotonic() - started, 1)


def _running_registry(bed_dir: Path) -> tuple[BedState, Service]:
    """A running bed's state and its Schema Registry's service (started or not)."""
    state = load_state(bed_dir)
    if state is None:
        raise TestbedError(f"no test bed is up at {bed_dir}: `kbit cluster up` first")
    registry = BedProcesses(bed_dir, replace(BedOptions(**state.options), registry=True)).registry
    assert registry is not None
    return state, registry


def start_registry(bed_dir: Path, timeout_s: float = 180.0) -> BedState:
    """The running bed with its Schema Registry started on the driver host (`kbit cluster up --registry` on a bed
    that is up) and recorded in its state; unchanged when it runs already. `down` stops it with the rest."""
    bed_dir = Path(bed_dir).resolve()
    state, registry = _running_registry(bed_dir)
    if state.registry_url is not None and registry.pid() is not None:
        return state
    started = time.monotonic()
    registry.start(timeout_s=max(timeout_s, 180.0))
    return _record_registry(bed_dir, state, registry.url, round(time.monotonic() - started, 1))


def stop_registry(bed_dir: Path) -> BedState:
    """The running bed without its Schema Registry (stopped, its schemas gone), as `up` without --registry makes it."""
    bed_dir = Path(bed_dir).resolve()
    state, registry = _running_registry(bed_dir)
    registry.stop(timeout_s=10)
    return _record_registry(bed_dir, state, None, None)


def _record_registry(bed_dir: Path, state: BedState, url: str | None, up_s: float | None) -> BedState:
    options = replace(BedOptions(**state.options), registry=url is not None)
    state = state.model_copy(update={"options": asdict(options), "registry_url": url, "registry_up_s": up_s})
    state_path(bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def _start_ray(procs: BedProcesses, timeout_s: float) -> None:
    """The Ray head, then the other nodes together; wait until every node host has joined."""
    ray_head, *ray_workers = procs.ray_nodes
    ray_head.start(timeout_s=timeout_s)
    with ThreadPoolExecutor(max(len(ray_workers), 1)) as pool:
        list(pool.map(lambda w: w.start(timeout_s=timeout_s), ray_workers))
    ray_cluster.wait_for_nodes(
        procs.ray_head_address, procs.ray_token, [n.address for n in procs.topology.nodes], timeout_s, procs.ray_nodes
    )


def _probe_broker(state: BedState, procs: BedProcesses, timeout_s: float = 15.0) -> None:
    """A metadata request over TLS and SCRAM, as the training user, must list every broker."""
    kafka = state.kafka_config()
    try:
        brokers = AdminClient({**confluent_options(kafka), "log_level": 0}).list_topics(timeout=timeout_s).brokers
    except Exception as exc:
        brokers, error = {}, str(exc)
    else:
        error = f"its metadata lists brokers {sorted(brokers)}"
    if len(brokers) != len(procs.kafka.brokers):
        tails = "\n".join(f"--- {b.service.name} ({b.server_log_path}):\n{b.log_tail(8)}" for b in procs.kafka.brokers)
        raise TestbedError(
            f"the Kafka cluster at {state.broker_bootstrap} does not answer the training user over TLS and SCRAM: "
            f"{error}\n{tails}"
        )


def status(bed_dir: Path) -> BedStatus:
    """Each process (alive? its hostname), the workers the master sees ALIVE, and what of the network exists."""
    bed_dir = Path(bed_dir).resolve()
    state = load_state(bed_dir)
    result = BedStatus(up=False, state=state, bridge=network.bridge_exists(), namespaces=network.bed_namespaces())
    if state is None:
        return result
    options = BedOptions(**state.options)
    procs = BedProcesses(bed_dir, options)
    for service, host in procs.all():
        pid = service.pid()
        result.processes.append(
            ProcessStatus(
                service.name,
                host.name,
                host.address,
                pid,
                pid is not None,
                hostname_of(pid) if pid else None,
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


def down(bed_dir: Path | None = None) -> list[str]:
    """Stop every process and remove every namespace and link the bed made; also after a crash. Idempotent.

    Processes are found three ways: the PID files under ``bed_dir`` (a clean stop), the processes
    inside the bed's namespaces, and any process carrying the bed's marker variable.
    """
    removed: list[str] = []
    state = load_state(bed_dir) if bed_dir is not None else None
    if state is not None:
        procs = BedProcesses(Path(bed_dir), BedOptions(**state.options))
        removed += [f"process {name}" for name in procs.kafka.stop(timeout_s=10)]
        for service, _host in procs.all()[len(procs.kafka.brokers) :]:
            if service.stop(timeout_s=10):
                removed.append(f"process {service.name}")
    leftovers = marked_pids() + [pid for ns in network.bed_namespaces() for pid in network.namespace_pids(ns)]
    if leftovers:
        terminate(leftovers)
        removed.append(f"{len(set(leftovers))} leftover process(es)")
    removed += log_disks.unmount_log_disks()  # once no broker holds one
    removed += network.destroy()
    removed += shaping.remove_loss_tables("kbit-")  # the root-side veth ends are kbit-<node> (Host.veth)
    if bed_dir is not None:
        removed += ssh_hosts.unlink_short_root(bed_dir)
        state_path(bed_dir).unlink(missing_ok=True)
        # the brokers' logs and the SCRAM passwords go with the bed: the next `up` formats a fresh cluster
        for made in (Path(bed_dir) / "run", Path(bed_dir) / "credentials"):
            if made.exists():
                shutil.rmtree(made, ignore_errors=True)
                removed.append(f"directory {made}")
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

"""The test bed's processes, as the Services that start, probe and stop them, for a bed directory and its options
(brokers, Spark master and workers, Ray, delay relays, the registry, sshd): what up, status and down all read."""

from __future__ import annotations

from pathlib import Path

from kbit_core import ray_env
from kbit_core.brokers.schema_registry import local_registry
from kbit_core.config import LocalRegistryConfig
from kbit_core.service import Service
from kbit_core.testbed import ray_cluster, shaping, ssh_hosts
from kbit_core.testbed.certs import certificate_paths
from kbit_core.testbed.kafka_bed import BedKafkaPorts, bed_kafka
from kbit_core.testbed.marked import MARKER_ENV
from kbit_core.testbed.network import Host, Topology
from kbit_core.testbed.spark_standalone import master_service, worker_service
from kbit_core.testbed.state import BedOptions


class BedProcesses:
    """The bed's processes (as Services) for a bed directory and options; used by up, status and down alike."""

    def __init__(self, bed_dir: Path, options: BedOptions) -> None:
        self.options = options
        self.topology = Topology.build(options.subnet, options.nodes)
        run_dir = Path(bed_dir).resolve() / "run"
        marker = {MARKER_ENV: str(Path(bed_dir).resolve())}
        driver = self.topology.driver
        ports = BedKafkaPorts(options.broker_port, options.broker_internal_port, options.broker_controller_port)
        self.certs = certificate_paths(Path(bed_dir).resolve() / "certs")
        self.kafka = bed_kafka(
            run_dir, self.topology.hosts, ports, self.certs, options.client_auth, marker, options.kafka_version
        )
        self.master = master_service(run_dir, driver, options.master_port, options.master_webui_port, marker)
        # on the driver host's bed address: the node hosts reach it over the bridge, nothing outside the machine does
        local = LocalRegistryConfig(host=driver.address, port=options.registry_port)
        self.registry = local_registry(run_dir, local, marker) if options.registry else None
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
        self.sshds = [
            ssh_hosts.sshd_service(Path(bed_dir).resolve(), run_dir, node, options.ssh_port, marker)
            for node in (self.topology.nodes if options.ssh else ())
        ]
        self.ray_token = ray_env.own_token_file(Path(bed_dir).resolve())
        self.ray_head_address, self.ray_nodes = _ray_services(run_dir, self.topology, options, marker, self.ray_token)

    def all(self) -> list[tuple[Service, Host]]:
        driver = self.topology.driver
        return [
            *((b.service, h) for b, h in zip(self.kafka.brokers, self.topology.hosts)),
            (self.master, driver),
            *zip(self.workers, self.topology.nodes),
            *zip(self.ray_nodes, self.topology.nodes),
            *zip(self.delay_relays, self.topology.nodes),
            *([(self.registry, driver)] if self.registry else []),
            *zip(self.sshds, self.topology.nodes),
        ]


def _ray_services(
    run_dir: Path, topology: Topology, options: BedOptions, marker: dict[str, str], token: Path
) -> tuple[str, list[Service]]:
    """The Ray head's address, and its Services with ``options.ray``: the head on the first node, then a worker on
    each further one."""
    head_node, *worker_nodes = topology.nodes
    head_address = f"{head_node.address}:{options.ray_head_port}"
    if not options.ray:
        return head_address, []
    head = ray_cluster.head_service(
        run_dir,
        head_node,
        options.ray_head_port,
        options.ray_client_port,
        options.worker_cores,
        options.ray_object_store_mb,
        marker,
        token,
    )
    workers = [
        ray_cluster.worker_service(
            run_dir, node, head_address, options.worker_cores, options.ray_object_store_mb, marker, token
        )
        for node in worker_nodes
    ]
    return head_address, [head, *workers]

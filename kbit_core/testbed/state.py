"""The test bed's options, its state file (what `up` made, read by every client of the bed) and its status."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kbit_core import ray_env
from kbit_core.config import KafkaConfig
from kbit_core.testbed import ray_cluster, ssh_hosts
from kbit_core.testbed.network import TestbedError

DEFAULT_SUBNET = "10.213.7.0/24"


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
    broker_port: int = 19093  # clients: SASL_SSL on each host's bed address
    broker_internal_port: int = 19094  # between the brokers: SSL with the brokers' certificate
    broker_controller_port: int = 19095  # the KRaft quorum: SSL with the brokers' certificate
    client_auth: bool = True  # mutual TLS: the brokers refuse clients without a certificate from the bed's CA
    ray: bool = field(default_factory=ray_cluster.ray_installed)  # Ray nodes on the node hosts (the `ray` extra)
    ray_head_port: int = 6380
    ray_client_port: int = 10001
    ray_object_store_mb: int = 256
    ssh: bool = field(default_factory=lambda: not ssh_hosts.missing_prerequisites())  # sshd per node (Ray's launcher)
    ssh_port: int = 22
    link: str | None = None  # RATE[,DELAY[,LOSS]]: every bed link shaped in both directions (shaping.py)
    delay_relay_port: int = 19400  # in each node's namespace, with a delay in ``link``
    registry: bool = False  # a Schema Registry (Apicurio, in memory) on the driver host's bed address
    registry_port: int = 18181  # its Confluent-compatible API; its health port is the next one
    log_disk_mb: int | None = None  # each broker's log directory on a tmpfs of this size (log_disks.py); None: none
    kafka_version: str | None = None  # the brokers' Apache Kafka release (installed beside kbit's); None: kbit's own


class BedHost(BaseModel):
    name: str
    address: str
    netns: str | None


class TeamStackState(BaseModel):
    """The team stack on the driver host (`kbit cluster up --team-stack`, kbit_core/bed_stack.py)."""

    workdir: Path  # its data (PostgreSQL, s3proxy's store, the logins) and logs
    prefect_api_url: str
    mlflow_url: str
    up_s: float  # how long its start took (PostgreSQL, s3proxy, both servers, deploy, worker)


class BedState(BaseModel):
    """What `up` made: the file the CLI, the tests and kbit configs read to reach the bed."""

    bed_dir: Path
    subnet: str
    driver: BedHost
    nodes: list[BedHost]
    master_url: str
    master_webui: str
    broker_bootstrap: str
    broker_up_s: float | None = None  # the three brokers' start, until all serve and the users and ACLs exist
    security_protocol: str = "SASL_SSL"
    sasl_username: str
    sasl_password_file: Path
    ssl_cafile: Path
    ssl_certfile: Path | None
    ssl_keyfile: Path | None
    ray_address: str | None = None  # Ray Client's address on the first node host; None: the bed runs no Ray
    registry_url: str | None = None  # the Schema Registry's Confluent-compatible API on the driver host, if it runs
    registry_up_s: float | None = None  # how long its start took
    ray_cluster_yaml: Path | None = None  # for Ray's own launcher (`ray up`) over the hosts' sshd; None: no sshd
    team_stack: TeamStackState | None = None  # PostgreSQL, s3proxy, Prefect and MLflow behind a login, if it runs
    options: dict[str, Any]

    def kafka_config(self) -> KafkaConfig:
        """The Kafka settings of the training user on the bed (what :meth:`kafka_overrides` sets)."""
        return KafkaConfig.model_validate({k.removeprefix("kafka."): v for k, v in self.kafka_overrides().items()})

    def kafka_overrides(self) -> dict[str, str]:
        """Dotted kbit config overrides that point the Kafka clients at the bed's cluster as the training user."""
        over = {
            "kafka.bootstrap_servers": self.broker_bootstrap,
            "kafka.broker_kind": "apache-kafka",
            "kafka.security_protocol": self.security_protocol,
            "kafka.sasl_mechanism": "SCRAM-SHA-512",
            "kafka.sasl_username": self.sasl_username,
            "kafka.sasl_password_file": str(self.sasl_password_file),
            "kafka.ssl_cafile": str(self.ssl_cafile),
            "kafka.topic_replication_factor": "3",
        }
        if self.ssl_certfile and self.ssl_keyfile:
            over |= {"kafka.ssl_certfile": str(self.ssl_certfile), "kafka.ssl_keyfile": str(self.ssl_keyfile)}
        return over

    def registry_overrides(self) -> dict[str, str]:
        """Dotted kbit config overrides that point kbit at the bed's Schema Registry."""
        if self.registry_url is None:
            raise TestbedError("this test bed runs no Schema Registry: `kbit cluster up --registry`")
        return {"registry.url": self.registry_url}

    def ray_overrides(self) -> dict[str, str]:
        """Dotted kbit config overrides that run the ranks on the bed's Ray nodes, with the bed's Ray token."""
        if self.ray_address is None:
            raise TestbedError("this test bed runs no Ray (the `ray` extra was not installed when it came up)")
        return {
            "launch.engine": "ray",
            "launch.ray_address": self.ray_address,
            "launch.ray_auth_token_file": str(ray_env.own_token_file(self.bed_dir)),
        }


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
    links: dict[str, str] = field(default_factory=dict)  # node -> the shaping in force on its link

    def to_dict(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "state": self.state.model_dump(mode="json") if self.state else None,
            "processes": [asdict(p) for p in self.processes],
            "alive_workers": self.alive_workers,
            "ray_nodes": self.ray_nodes,
            "bridge": self.bridge,
            "namespaces": self.namespaces,
            "links": self.links,
        }


def state_path(bed_dir: Path) -> Path:
    return Path(bed_dir) / "state.json"


def load_state(bed_dir: Path) -> BedState | None:
    """The state `up` wrote, or None when the bed was never brought up here (or `down` removed it)."""
    try:
        return BedState.model_validate_json(state_path(bed_dir).read_text())
    except (OSError, ValueError):
        return None

"""The test bed's Kafka: Apache Kafka on every bed host (one KRaft node each, a three-voter quorum), topics replicated
three times with min.insync.replicas=2; TLS terminated by the brokers, SCRAM-SHA-512 users and ACLs made by the bed.

Listeners on each host's bed address: CLIENT (SASL_SSL, SCRAM-SHA-512, plus a client certificate from the bed's CA
when ``client_auth``), INTERNAL (SSL between the brokers, mutual, as the super user ``User:CN=kbit-broker``) and
CONTROLLER (the same for the quorum). The StandardAuthorizer allows nothing without an ACL.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from kbit_core.brokers.cluster import ClusterNode, KafkaCluster
from kbit_core.testbed.certs import BROKER_CN, BedCertificates
from kbit_core.testbed.network import Host, TestbedError, in_host

# The principal kbit's clients use: every operation on topics and consumer groups named with TOPIC_PREFIX, nothing else.
TRAIN_USER = "kbit-train"
# A principal that authenticates but that no ACL names: what a client without the ACL sees.
STRANGER_USER = "kbit-stranger"
TOPIC_PREFIX = "kbit"
MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
# Three brokers, Spark and the ranks share 2 cores and 24 GiB: a small heap and thread pools per broker.
BROKER_HEAP = "512m"


@dataclass(frozen=True)
class BedKafkaPorts:
    client: int
    internal: int
    controller: int


def password_path(bed_dir: Path, user: str) -> Path:
    return Path(bed_dir) / "credentials" / f"{user}.password"


def _properties(node: ClusterNode, ports: BedKafkaPorts, certs: BedCertificates, client_auth: bool) -> dict[str, str]:
    a = node.host
    return {
        "listeners": f"CLIENT://{a}:{ports.client},INTERNAL://{a}:{ports.internal},CONTROLLER://{a}:{ports.controller}",
        "advertised.listeners": f"CLIENT://{a}:{ports.client},INTERNAL://{a}:{ports.internal}",
        "listener.security.protocol.map": "CLIENT:SASL_SSL,INTERNAL:SSL,CONTROLLER:SSL",
        "inter.broker.listener.name": "INTERNAL",
        "controller.listener.names": "CONTROLLER",
        "sasl.enabled.mechanisms": MECHANISM,
        "listener.name.client.sasl.enabled.mechanisms": MECHANISM,
        "listener.name.client.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(certs.server_keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(certs.ca),
        "ssl.client.auth": "required",
        "listener.name.client.ssl.client.auth": "required" if client_auth else "none",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:CN={BROKER_CN}",
        "allow.everyone.if.no.acl.found": "false",
    }


def bed_kafka(
    run_dir: Path,
    hosts: tuple[Host, ...],
    ports: BedKafkaPorts,
    certs: BedCertificates,
    client_auth: bool,
    env: dict,
    kafka_version: str | None = None,
) -> KafkaCluster:
    """The cluster's nodes, one per bed host (``kafka-<host>``), run inside the host's namespace, on Apache Kafka
    ``kafka_version`` (default: the installed broker's)."""
    nodes = [
        ClusterNode(
            f"kafka-{h.name}",
            h.address,
            ports.client,
            ports.controller,
            launch=(lambda argv, h=h: in_host(h, argv)) if h.netns else None,
        )
        for h in hosts
    ]
    admin: dict[str, Any] = {
        "security.protocol": "SSL",
        "ssl.ca.location": str(certs.ca),
        "ssl.certificate.location": str(certs.server_cert),
        "ssl.key.location": str(certs.server_key),
    }
    return KafkaCluster(
        run_dir,
        nodes,
        properties=lambda node: _properties(node, ports, certs, client_auth),
        admin_options=admin,
        admin_bootstrap=lambda node: f"{node.host}:{ports.internal}",
        env=env,
        heap_max=BROKER_HEAP,
        kafka_version=kafka_version,
    )


def create_users_and_acls(cluster: KafkaCluster, bed_dir: Path, timeout_s: float = 30.0) -> None:
    """SCRAM-SHA-512 users with fresh random passwords (files readable by their owner only), and the ACLs that let
    TRAIN_USER use the topics and groups named ``kbit*``; STRANGER_USER gets no ACL."""
    upserts = []
    for user in (TRAIN_USER, STRANGER_USER):
        path = password_path(bed_dir, user)
        path.parent.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(24)
        path.touch(mode=0o600)
        path.write_text(password + "\n")
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
        upserts.append(UserScramCredentialUpsertion(user, info, password.encode()))
    acls = [
        AclBinding(
            resource,
            TOPIC_PREFIX,
            ResourcePatternType.PREFIXED,
            f"User:{TRAIN_USER}",
            "*",
            AclOperation.ALL,
            AclPermissionType.ALLOW,
        )
        for resource in (ResourceType.TOPIC, ResourceType.GROUP)
    ]
    admin = cluster.admin()
    try:
        for future in [*admin.alter_user_scram_credentials(upserts).values(), *admin.create_acls(acls).values()]:
            future.result(timeout=timeout_s)
    except Exception as exc:
        raise TestbedError(f"creating the bed's SCRAM users and ACLs failed: {exc}") from None

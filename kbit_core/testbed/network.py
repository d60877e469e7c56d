"""The test bed's private network: a bridge in the root namespace (the driver host), a network namespace per node."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kbit_core.errors import KbitError

BRIDGE = "kbit-br0"
NETNS_PREFIX = "kbit-node"
# `ip netns exec` bind-mounts /etc/netns/<ns>/<file> over /etc/<file>: each node resolves the bed's
# names from its own hosts file and has no DNS server, so no lookup ever leaves the bed.
NETNS_ETC = Path("/etc/netns")


class TestbedError(KbitError):
    """The multi-host test bed cannot be created, started, reached or removed."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True)
class Host:
    name: str  # hostname seen by processes on the host (driver, node1, ...)
    address: str
    netns: str | None  # None: the root namespace

    @property
    def veth(self) -> str | None:
        """Root-side end of the node's veth pair (the end inside the namespace is eth0)."""
        return None if self.netns is None else f"kbit-{self.name}"


@dataclass(frozen=True)
class Topology:
    subnet: ipaddress.IPv4Network
    driver: Host
    nodes: tuple[Host, ...]

    @classmethod
    def build(cls, subnet: str = "10.213.7.0/24", num_nodes: int = 2) -> Topology:
        net = ipaddress.IPv4Network(subnet)
        if not net.is_private:
            raise TestbedError(
                f"test bed subnet {subnet} is not a private range; pick one from 10/8, 172.16/12 "
                "or 192.168/16 that no interface of this machine uses"
            )
        if net.num_addresses < 16 + num_nodes:
            raise TestbedError(f"test bed subnet {subnet} is too small for {num_nodes} nodes")
        base = net.network_address
        nodes = tuple(Host(f"node{i}", str(base + 10 + i), f"{NETNS_PREFIX}{i}") for i in range(1, num_nodes + 1))
        return cls(net, Host("driver", str(base + 1), None), nodes)

    @property
    def hosts(self) -> tuple[Host, ...]:
        return (self.driver, *self.nodes)

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", *(f"{h.address} {h.name}" for h in self.hosts)]
        return "\n".join(lines) + "\n"


def missing_prerequisites() -> list[str]:
    """What this machine lacks to build the bed (root, Linux, the `ip` and `unshare` tools)."""
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append(f"Linux (this is {sys.platform})")
    elif os.geteuid() != 0:
        missing.append("root (network namespaces and bridges need CAP_NET_ADMIN; run as root)")
    missing += [f"the `{tool}` command" for tool in ("ip", "unshare") if shutil.which(tool) is None]
    return missing


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TestbedError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def bridge_exists() -> bool:
    return shutil.which("ip") is not None and _ip("link", "show", BRIDGE, check=False).returncode == 0


def bridge_networks() -> list[ipaddress.IPv4Network]:
    """The subnets assigned to the bed's bridge (empty when it does not exist)."""
    if not bridge_exists():
        return []
    data = json.loads(_ip("-j", "addr", "show", BRIDGE).stdout or "[]")
    return [
        ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}").network
        for link in data
        for a in link.get("addr_info", [])
        if a.get("family") == "inet"
    ]


def bed_namespaces() -> list[str]:
    """Every network namespace the bed may have made (kbit-node*), also ones a crashed run left."""
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NETNS_PREFIX)]


def bed_links() -> list[str]:
    """Root-namespace links the bed made: the bridge and the root-side veth ends."""
    if shutil.which("ip") is None:
        return []
    data = json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")
    return [link["ifname"] for link in data if link["ifname"].startswith("kbit-")]


def _taken_networks() -> list[ipaddress.IPv4Network]:
    data = json.loads(_ip("-j", "addr", "show").stdout or "[]")
    return [
        ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}").network
        for link in data
        if link["ifname"] != BRIDGE
        for a in link.get("addr_info", [])
        if a.get("family") == "inet"
    ]


def create(topology: Topology) -> None:
    """Bridge with the driver's address, then per node: namespace, veth pair, address, lo up, hosts file.

    Only links named kbit-* are touched; no route or forwarding setting of the machine changes.
    """
    clash = [n for n in _taken_networks() if n.overlaps(topology.subnet)]
    if clash:
        raise TestbedError(
            f"test bed subnet {topology.subnet} overlaps {clash[0]} already used on this machine; choose another subnet"
        )
    prefix = topology.subnet.prefixlen
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{topology.driver.address}/{prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for node in topology.nodes:
        assert node.netns is not None and node.veth is not None
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", node.veth, "master", BRIDGE)
        _ip("link", "set", node.veth, "up")
        _ip("-n", node.netns, "addr", "add", f"{node.address}/{prefix}", "dev", "eth0")
        _ip("-n", node.netns, "link", "set", "eth0", "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        etc = NETNS_ETC / node.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(topology.hosts_file())
        (etc / "resolv.conf").write_text("")
        (etc / "hostname").write_text(node.name + "\n")


def namespace_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def destroy() -> list[str]:
    """Remove every kbit-* namespace and link and the namespaces' /etc files; returns what was removed."""
    removed = []
    for netns in bed_namespaces():
        _ip("netns", "delete", netns, check=False)  # its veth end goes with it, and with that the peer
        shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        removed.append(f"netns {netns}")
    for link in bed_links():
        if _ip("link", "delete", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    return removed


def in_host(host: Host, argv: Sequence[str]) -> list[str]:
    """Command line running ``argv`` on ``host``: inside its namespace, under its own hostname."""
    if host.netns is None:
        return list(argv)
    # Every step execs the next, so the recorded PID ends up being the service itself.
    return [
        "ip",
        "netns",
        "exec",
        host.netns,
        "unshare",
        "--uts",
        "sh",
        "-c",
        f'hostname {host.name} && exec "$@"',
        "sh",
        *argv,
    ]

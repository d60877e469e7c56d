"""Shaped links, measured: rate, delay and loss on a veth pair of the tests' own (kbs-*), never the bed's kbit-*.

A namespace ``kbs-n1`` (eth0, 10.213.97.11) is joined to the root namespace (kbs-t1, 10.213.97.1) as a bed node is
joined to the driver; every test shapes both ends with kbit's own functions and measures across the link.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from scipy import stats

from kbit_core.testbed import shaping
from kbit_core.testbed.delay_relay import relay
from kbit_core.testbed.network import Host
from kbit_core.testbed.shaping import LinkEnd, LinkShape
from tests.conftest import free_port, unavailable
from tests.testbed import wire_probe

NETNS, ROOT_DEVICE = "kbs-n1", "kbs-t1"
ROOT_ADDRESS, NODE_ADDRESS = "10.213.97.1", "10.213.97.11"
PROBE = Path(__file__).with_name("wire_probe.py")
FRAME_PAYLOAD = 1448 / 1514  # TCP payload per Ethernet frame (MSS with timestamps): tbf counts whole frames


@dataclass(frozen=True)
class Link:
    root: LinkEnd
    node: LinkEnd
    node_host: Host

    def shape(self, shape: LinkShape, relays: tuple[shaping.Service, ...] = (), relay_port: int = 0) -> None:
        """As the bed shapes each node's link."""
        shaping.shape_links([(self.root, self.node)], shape, relays, relay_port)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _mac(*netns_and_device: str) -> str:
    out = subprocess.run(
        ["ip", *netns_and_device[:-1], "-j", "link", "show", netns_and_device[-1]],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)[0]["address"]


def _pin_neighbours() -> None:
    """Static neighbour entries on both ends: with loss configured, a lost ARP request or reply holds the first
    datagrams back for the kernel's one-second retry (and drops those past its queue), which a measurement of the
    link's own loss must not count."""
    root_mac, node_mac = _mac(ROOT_DEVICE), _mac("-n", NETNS, "eth0")
    _ip("neigh", "replace", NODE_ADDRESS, "lladdr", node_mac, "dev", ROOT_DEVICE, "nud", "permanent")
    _ip("-n", NETNS, "neigh", "replace", ROOT_ADDRESS, "lladdr", root_mac, "dev", "eth0", "nud", "permanent")


def _remove_link() -> None:
    pids = subprocess.run(["ip", "netns", "pids", NETNS], capture_output=True, text=True).stdout.split()
    for pid in pids:
        os.kill(int(pid), 9)
    shaping.clear_end(LinkEnd(None, ROOT_DEVICE))
    subprocess.run(["ip", "netns", "delete", NETNS], capture_output=True)  # takes the veth pair with it


@contextmanager
def veth_link() -> Iterator[Link]:
    """The veth pair, unshaped; removed afterwards with its qdiscs, nft tables and the processes in the namespace."""
    _remove_link()  # what a killed run left
    try:
        _ip("netns", "add", NETNS)
        _ip("link", "add", ROOT_DEVICE, "type", "veth", "peer", "name", "eth0", "netns", NETNS)
        _ip("addr", "add", f"{ROOT_ADDRESS}/24", "dev", ROOT_DEVICE)
        _ip("link", "set", ROOT_DEVICE, "up")
        _ip("-n", NETNS, "addr", "add", f"{NODE_ADDRESS}/24", "dev", "eth0")
        _ip("-n", NETNS, "link", "set", "eth0", "up")
        _ip("-n", NETNS, "link", "set", "lo", "up")
        _pin_neighbours()
        yield Link(LinkEnd(None, ROOT_DEVICE), LinkEnd(NETNS, "eth0"), Host("kbs-node", NODE_ADDRESS, NETNS))
    finally:
        _remove_link()


@pytest.fixture
def link() -> Iterator[Link]:
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("shaping needs root on Linux and the `ip` command")
    missing = shaping.missing_prerequisites()
    if missing:
        unavailable("shaping cannot run here; missing: " + "; ".join(missing))
    with veth_link() as made:
        yield made


def in_node(*args: Any) -> subprocess.Popen[str]:
    argv = ["ip", "netns", "exec", NETNS, sys.executable, str(PROBE), *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen[str], timeout_s: float = 60) -> Any:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def await_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and json.loads(proc.stdout.readline()) == "ready", proc.stderr


def transfer(towards_node: bool, nbytes: int, port: int) -> dict[str, float]:
    """Raw bytes across the link; the receiving end reports bytes and seconds."""
    if towards_node:
        sink = in_node("sink", NODE_ADDRESS, port)
        await_ready(sink)
        wire_probe.send(NODE_ADDRESS, port, nbytes)
        return result_of(sink)
    with socket.create_server((ROOT_ADDRESS, port)) as listener:
        sender = in_node("send", ROOT_ADDRESS, port, nbytes)
        received = wire_probe.sink(listener)
        result_of(sender)
        return received


def goodput_ratio(measured: dict[str, float], shape: LinkShape) -> float:
    return measured["bytes"] * 8 / measured["seconds"] / (shape.rate_bit_s * FRAME_PAYLOAD)


@pytest.mark.parametrize("towards_node", [True, False], ids=["towards-node", "from-node"])
def test_a_raw_transfer_runs_at_the_configured_rate(link: Link, towards_node: bool):
    shape = LinkShape(40 * 10**6)
    unshaped = transfer(towards_node, 16 << 20, free_port())
    link.shape(shape)
    assert goodput_ratio(unshaped, shape) > 2, "the bare link must be faster than the shaping, or this proves nothing"
    assert goodput_ratio(transfer(towards_node, 8 << 20, free_port()), shape) == pytest.approx(1, abs=0.15)


def datagrams_received(towards_node: bool, sent: int, port: int) -> int:
    """Of ``sent`` UDP datagrams across the link, how many arrived."""
    if towards_node:
        counter = in_node("udp-count", NODE_ADDRESS, port)
        await_ready(counter)
        wire_probe.udp_send(NODE_ADDRESS, port, sent)
        return result_of(counter)
    with wire_probe.udp_receiver(ROOT_ADDRESS, port) as sock:
        sender = in_node("udp-send", ROOT_ADDRESS, port, sent)
        received = wire_probe.udp_count(sock)
        result_of(sender)
        return received


@pytest.mark.parametrize("towards_node", [True, False], ids=["towards-node", "from-node"])
def test_the_drop_rate_lies_in_its_binomial_interval(link: Link, towards_node: bool):
    shape, sent, port = LinkShape(10**9, loss=0.05), 4000, free_port()
    link.shape(shape)
    received = datagrams_received(towards_node, sent, port)
    low, high = stats.binom.interval(0.999, sent, 1 - shape.loss)
    assert low <= received <= high, f"{sent - received} of {sent} datagrams lost, configured {shape.loss:.1%}"


def forward(target: str) -> socket.socket:
    """A listening port on the root end relaying to ``target`` (e.g. the broker on loopback); close it to stop."""
    host, port = target.rsplit(":", 1)
    listener = socket.create_server((ROOT_ADDRESS, 0))

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=relay, args=(client, (host, int(port)), 0.0, 0), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def kafka_round_trip(port: int, count: int = 40) -> float:
    """Median seconds of an ApiVersions request from the node to the root end's ``port``."""
    return statistics.median(result_of(in_node("kafka", ROOT_ADDRESS, port, count)))


def delay_link(link: Link, shape: LinkShape, tmp_path: Path) -> shaping.Service:
    relay_port = free_port()
    service = shaping.relay_service(tmp_path, link.node_host, shape, relay_port, {})
    link.shape(shape, (service,), relay_port)
    return service


@pytest.mark.kafka
def test_a_kafka_request_round_trip_takes_twice_the_delay(link: Link, broker: Any, tmp_path: Path):
    """What the shaping adds to the median ApiVersions round trip is two delays (the bare link's round trip, mostly
    the broker's and the scheduler's time on a busy machine, is measured first and taken off)."""
    shape = LinkShape(10**9, delay_s=0.02)
    with forward(broker.bootstrap) as forwarder:
        broker_port = forwarder.getsockname()[1]
        bare = kafka_round_trip(broker_port)
        relay_service = delay_link(link, shape, tmp_path)
        try:
            shaped = kafka_round_trip(broker_port)
        finally:
            relay_service.stop()
    print(f"round trip: bare {bare * 1e3:.2f} ms, shaped {shaped * 1e3:.2f} ms, delay {shape.delay_s * 1e3:g} ms")
    assert bare < shape.delay_s, f"the bare link's round trip ({bare * 1e3:.2f} ms) would hide the delay"
    assert shaped - bare == pytest.approx(2 * shape.delay_s, rel=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("towards_node", [True, False], ids=["towards-node", "from-node"])
def test_the_delay_relay_keeps_the_configured_rate(link: Link, tmp_path: Path, towards_node: bool):
    shape = LinkShape(100 * 10**6, delay_s=0.002)
    relay_service = delay_link(link, shape, tmp_path)
    try:
        measured = transfer(towards_node, 24 << 20, free_port())
    finally:
        relay_service.stop()
    assert goodput_ratio(measured, shape) == pytest.approx(1, abs=0.15)


def test_a_delayed_link_refuses_a_port_nobody_serves_and_delays_one_that_is_served(link: Link, tmp_path: Path):
    """The relay takes only connections to a port that a socket in the node listens on: a broker about to start
    must find its port free, and a client a port that nothing serves refused (it used to be accepted by the relay,
    so the bed's brokers on the nodes never started: their port looked taken)."""
    shape = LinkShape(10**9, delay_s=0.05)
    relay_service = delay_link(link, shape, tmp_path)
    unserved = free_port()
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((NODE_ADDRESS, unserved), timeout=10).close()
        sink = in_node("sink", NODE_ADDRESS, unserved)
        await_ready(sink)
        with socket.create_connection((NODE_ADDRESS, unserved), timeout=10) as conn:
            conn.sendall(b"x" * 10)
        received = result_of(sink)
    finally:
        relay_service.stop()
    assert received["first"] == 10 and received["peer"] == NODE_ADDRESS, "the served port was not relayed"


def test_the_shaping_in_force_is_read_back_from_the_kernel(link: Link, tmp_path: Path):
    assert shaping.link_in_force(link.root, link.node) == "unshaped"
    shape = LinkShape.parse("100mbit,2ms,0.1%")
    delay_link(link, shape, tmp_path).stop()
    assert shaping.shape_in_force(link.node) == shape
    assert shaping.shape_in_force(link.root) == LinkShape(shape.rate_bit_s, 0.0, shape.loss)
    assert shaping.link_in_force(link.root, link.node) == shape.describe()
    shaping.shape_end(link.root, LinkShape(10**9))
    assert shaping.link_in_force(link.root, link.node).startswith("shaped unevenly: towards the node 1 gbit/s")


def test_removing_the_links_leaves_no_loss_table(link: Link):
    """A netdev table outlives its device: `kbit cluster down` removes those of its links by name."""
    link.shape(LinkShape(10**9, loss=0.01))
    subprocess.run(["ip", "link", "delete", ROOT_DEVICE], check=True)
    assert shaping.remove_loss_tables("kbs-t") == [f"nft table netdev {link.root.table}"]
    assert shaping.remove_loss_tables("kbs-t") == []

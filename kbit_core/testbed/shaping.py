"""Shaped links on the test bed: a rate, a one-way delay and a loss rate on every link, in both directions.

This kernel has no netem, so each property comes from what it does have:

* rate: a ``tbf`` qdisc on each end of a veth pair shapes what leaves that end (the root-side end shapes the
  traffic towards the node, the node's eth0 the traffic from it);
* loss: an nftables ``netdev`` table on each end drops arriving packets at random (``numgen random``), so a
  dropped packet is lost on the wire, never refused to the sender's socket;
* delay: a relay inside the node's namespace (:mod:`kbit_core.testbed.delay_relay`) that every TCP connection
  crossing the node's eth0 is redirected through (nftables ``redirect``); it holds each direction's bytes for the
  delay. TCP only: UDP and ICMP cross undelayed (nothing on the bed speaks UDP).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from kbit_core.config import LOOPBACK
from kbit_core.service import Service
from kbit_core.testbed.network import Host, TestbedError, in_host
from kbit_core.testbed.state import BedOptions

_RATE_UNITS = {"bit": Decimal(1), "kbit": Decimal(10**3), "mbit": Decimal(10**6), "gbit": Decimal(10**9)}
_DELAY_UNITS = {"us": Decimal("1e-6"), "ms": Decimal("1e-3"), "s": Decimal(1)}
_LOSS_SCALE = 1_000_000  # numgen's modulus: loss rates resolve to one in a million
MIN_RATE_BIT_S = 100_000
MAX_RATE_BIT_S = 100 * 10**9
MAX_DELAY_S = 10.0
RELAY_MARK = 0x6B62  # the relay's own upstream connections carry this mark and are not redirected again
DELAY_TABLE = "kbit_delay"
_FORMAT = "RATE[,DELAY[,LOSS]], e.g. 1gbit,0.5ms or 100mbit,2ms,0.1%"


@dataclass(frozen=True)
class LinkShape:
    """What every shaped link does, in each direction: ``rate_bit_s``, one-way ``delay_s``, ``loss`` (a fraction)."""

    rate_bit_s: int
    delay_s: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, spec: str, where: str = "--link", separator: str = ",") -> LinkShape:
        """``RATE[,DELAY[,LOSS]]``: rate in bit/kbit/mbit/gbit per second, delay in us/ms/s, loss in %."""
        parts = [p.strip().lower() for p in spec.split(separator)]
        if not 1 <= len(parts) <= 3 or not all(parts):
            raise TestbedError(f"{where} {spec!r}: expected {_FORMAT.replace(',', separator)}")
        rate = _number_with_unit(parts[0], _RATE_UNITS, where, spec, "rate")
        delay = _number_with_unit(parts[1], _DELAY_UNITS, where, spec, "delay") if len(parts) > 1 else 0.0
        loss = _percentage(parts[2], where, spec) if len(parts) > 2 else 0.0
        if not MIN_RATE_BIT_S <= rate <= MAX_RATE_BIT_S:
            raise TestbedError(f"{where} {spec!r}: rate {parts[0]} is outside 100kbit..100gbit")
        if delay > MAX_DELAY_S:
            raise TestbedError(f"{where} {spec!r}: delay {parts[1]} is over {MAX_DELAY_S:g}s")
        return cls(int(rate), delay, loss)

    def spec(self) -> str:
        """The canonical ``--link`` text (``LinkShape.parse(shape.spec()) == shape``)."""
        rate = next(
            f"{self.rate_bit_s // int(f)}{u}" for u, f in reversed(_RATE_UNITS.items()) if self.rate_bit_s % int(f) == 0
        )
        return f"{rate},{self.delay_s * 1e3:g}ms,{self.loss * 100:g}%"

    def describe(self) -> str:
        return (
            f"{_human_rate(self.rate_bit_s)}, {self.delay_s * 1e3:g} ms each way (TCP), "
            f"{self.loss * 100:g}% loss, in both directions"
        )


def network_shape(name: str, where: str = "bench.networks") -> LinkShape | None:
    """The link of a benchmark's network profile: ``loopback`` (links unshaped: None) or ``RATE[-DELAY[-LOSS]]``,
    e.g. ``10gbit-0.2ms``, ``1gbit-0.5ms``, ``100mbit-2ms`` (``--link`` with dashes: a name that fits a file)."""
    return None if name == LOOPBACK else LinkShape.parse(name, where, separator="-")


def _number_with_unit(text: str, units: dict[str, Decimal], where: str, spec: str, what: str) -> float:
    """Decimal arithmetic, so that 200us is exactly the float 0.0002 that 0.2ms is."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text)
    if match is None or match.group(2) not in units:
        raise TestbedError(f"{where} {spec!r}: {what} {text!r} needs a number and one of {', '.join(units)}")
    return float(Decimal(match.group(1)) * units[match.group(2)])


def _percentage(text: str, where: str, spec: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
    if match is None or float(match.group(1)) >= 100:
        raise TestbedError(f"{where} {spec!r}: loss {text!r} must be a percentage below 100%, e.g. 0.1%")
    return float(Decimal(match.group(1)) / 100)


def _human_rate(bit_s: float) -> str:
    for unit, factor in reversed(_RATE_UNITS.items()):
        if bit_s >= factor:
            return f"{bit_s / factor:g} {unit}/s"
    return f"{bit_s:g} bit/s"


@dataclass(frozen=True)
class LinkEnd:
    """One end of a veth pair: ``device`` inside ``netns`` (None: the root namespace)."""

    netns: str | None
    device: str

    @property
    def table(self) -> str:
        """The end's nftables loss table (netdev family, one per device so ends never share one)."""
        return "kbit_loss_" + re.sub(r"[^A-Za-z0-9_]", "_", self.device)

    def argv(self, *argv: str) -> list[str]:
        return list(argv) if self.netns is None else ["ip", "netns", "exec", self.netns, *argv]


def missing_prerequisites() -> list[str]:
    """What shaping needs beyond the bed itself: the `tc` and `nft` commands."""
    missing = [] if shutil.which("tc") else ["the `tc` command (iproute2) for link rates"]
    if shutil.which("nft") is None:
        missing.append(
            "the `nft` command for link loss and delay: install the `nftables` package (apt-get install nftables)"
        )
    return missing


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def tbf_command(end: LinkEnd, shape: LinkShape) -> list[str]:
    """The qdisc that limits what leaves ``end`` to the shape's rate.

    The bucket holds 1 ms at the rate (16 KiB at least, a few full frames): small enough that a transfer's first
    burst barely shows, and tbf splits larger GSO packets itself. The queue holds 20 ms at the rate.
    """
    burst = max(shape.rate_bit_s // 8 // 1000, 16 * 1024)
    return end.argv(
        "tc", "qdisc", "replace", "dev", end.device, "root", "tbf",
        "rate", f"{shape.rate_bit_s}bit", "burst", str(burst), "latency", "20ms",
    )  # fmt: skip


def loss_ruleset(end: LinkEnd, shape: LinkShape) -> str:
    """nftables input that drops packets arriving at ``end`` with the shape's probability."""
    threshold = round(shape.loss * _LOSS_SCALE)
    return (
        f"table netdev {end.table} {{\n"
        f'  chain ingress {{ type filter hook ingress device "{end.device}" priority 0;\n'
        f"    numgen random mod {_LOSS_SCALE} < {threshold} counter drop;\n  }}\n}}\n"
    )


def delay_ruleset(device: str, relay_port: int, shape: LinkShape) -> str:
    """nftables input (for the node's namespace) sending every TCP connection across ``device`` through the relay.

    Connections the node opens are redirected on output, connections to the node on prerouting; the relay's own
    upstream connections carry :data:`RELAY_MARK`, and the relay's port itself is left alone (its health probe).
    Only a connection's opening SYN is redirected: when the table appears on a bed that is already running
    (``bed.reshape``), conntrack picks its open connections up mid-stream as new ones, and redirecting those to the
    relay would reset them (the Spark workers' links to their master).
    A connection to the node is redirected only when a socket in the node listens on its port (``socket wildcard``
    finds one, bound to the address or to any): the relay would otherwise accept it for a port nobody serves, and
    whoever asks whether the port is free or open (a service about to start, a health check, a client) would be told
    it is taken or open. Without one the node's kernel refuses the connection, as on the bare link.
    """
    comment = f'comment "delay {shape.delay_s * 1e3:g}ms"'
    opening = "tcp flags & (syn | ack) == syn"
    served = "socket wildcard { 0, 1 }"
    return (
        f"table ip {DELAY_TABLE}\ndelete table ip {DELAY_TABLE}\n"  # replaces an earlier one in the same transaction
        f"table ip {DELAY_TABLE} {{\n"
        f"  chain out {{ type nat hook output priority -100;\n"
        f'    oifname "{device}" meta mark != {RELAY_MARK:#x} {opening} redirect to :{relay_port} {comment};\n'
        f"  }}\n"
        f"  chain pre {{ type nat hook prerouting priority -100;\n"
        f'    iifname "{device}" tcp dport != {relay_port} {opening} {served} redirect to :{relay_port} {comment};\n'
        f"  }}\n}}\n"
    )


def shape_end(end: LinkEnd, shape: LinkShape) -> None:
    """Rate on what leaves ``end``, loss on what arrives at it (replacing any earlier shaping of the end)."""
    clear_end(end)
    _run(tbf_command(end, shape))
    if shape.loss > 0:
        _run(end.argv("nft", "-f", "-"), stdin=loss_ruleset(end, shape))


def clear_end(end: LinkEnd) -> None:
    """Remove the end's qdisc, loss table and (in a namespace) the delay relay's redirect; the device stays.
    Idempotent."""
    _run(end.argv("tc", "qdisc", "del", "dev", end.device, "root"), check=False)
    if shutil.which("nft"):
        _run(end.argv("nft", "delete", "table", "netdev", end.table), check=False)
        if end.netns is not None:
            _run(end.argv("nft", "delete", "table", "ip", DELAY_TABLE), check=False)


def remove_loss_tables(device_prefix: str) -> list[str]:
    """Delete the root namespace's loss tables of devices named ``device_prefix``*: a netdev table outlives its
    device (its chain just loses the hook), so removing the links leaves them behind."""
    if shutil.which("nft") is None:
        return []
    listing = json.loads(_run(["nft", "-j", "list", "tables", "netdev"], check=False).stdout or "{}")
    prefix = LinkEnd(None, device_prefix).table
    names = [t["table"]["name"] for t in listing.get("nftables", []) if "table" in t]
    stale = [name for name in names if name.startswith(prefix)]
    for name in stale:
        _run(["nft", "delete", "table", "netdev", name], check=False)
    return [f"nft table netdev {name}" for name in stale]


def link_ends(node: Host) -> tuple[LinkEnd, LinkEnd]:
    """A bed node's link: the root-side veth end (kbit-<node>), then the node's eth0."""
    assert node.netns is not None and node.veth is not None
    return LinkEnd(None, node.veth), LinkEnd(node.netns, "eth0")


def shape_links(
    links: Sequence[tuple[LinkEnd, LinkEnd]], shape: LinkShape, relays: Sequence[Service], relay_port: int
) -> None:
    """Shape both ends of every (root end, node end) link; start each node's delay relay (``relays``: one per link,
    or none without a delay) and redirect the node's TCP through it."""
    for root_end, node_end in links:
        shape_end(root_end, shape)
        shape_end(node_end, shape)
    for (_, node_end), relay in zip(links, relays):
        assert node_end.netns is not None
        relay.start(timeout_s=30)
        redirect_through_relay(node_end.netns, node_end.device, relay_port, shape)


def link_in_force(root_end: LinkEnd, node_end: LinkEnd) -> str:
    """``kbit cluster status``'s words for the shaping the kernel applies on a link, read at both ends."""
    towards, away = shape_in_force(root_end), shape_in_force(node_end)
    if towards is None and away is None:
        return "unshaped"
    if towards is None or away is None or (towards.rate_bit_s, towards.loss) != (away.rate_bit_s, away.loss):
        return f"shaped unevenly: towards the node {towards and towards.describe()}, from it {away and away.describe()}"
    return away.describe()


def redirect_through_relay(netns: str, device: str, relay_port: int, shape: LinkShape) -> None:
    _run(["ip", "netns", "exec", netns, "nft", "-f", "-"], stdin=delay_ruleset(device, relay_port, shape))


def shape_in_force(end: LinkEnd) -> LinkShape | None:
    """The shaping the kernel applies at ``end`` (its tbf rate, its loss rule and, in a namespace with the delay
    relay's redirect, the delay), read back from tc and nft; None when the end is not shaped."""
    if shutil.which("tc") is None:  # then nothing can have shaped it
        return None
    qdiscs = json.loads(_run(end.argv("tc", "-j", "qdisc", "show", "dev", end.device), check=False).stdout or "[]")
    tbf = next((q for q in qdiscs if q.get("kind") == "tbf" and q.get("root")), None)
    if tbf is None:
        return None
    loss = _nft_numbers(end, ["netdev", end.table], r"numgen random mod (\d+) < (\d+)")
    delay = _nft_numbers(end, ["ip", DELAY_TABLE], r'comment "delay ([\d.]+)ms"') if end.netns else None
    return LinkShape(
        rate_bit_s=int(tbf["options"]["rate"]) * 8,
        delay_s=float(delay[0]) / 1e3 if delay else 0.0,
        loss=int(loss[1]) / int(loss[0]) if loss else 0.0,
    )


def _nft_numbers(end: LinkEnd, table: list[str], pattern: str) -> tuple[str, ...] | None:
    if shutil.which("nft") is None:
        return None
    listing = _run(end.argv("nft", "list", "table", *table), check=False).stdout
    match = re.search(pattern, listing)
    return match.groups() if match else None


def relay_service(run_dir: Path, host: Host, shape: LinkShape, port: int, env: dict[str, str]) -> Service:
    """The delay relay of ``host`` (a node), listening on its loopback and bed address inside its namespace."""
    argv = [
        sys.executable, "-m", "kbit_core.testbed.delay_relay",
        "--listen", f"127.0.0.1,{host.address}", "--port", str(port),
        "--delay-ms", f"{shape.delay_s * 1e3:g}", "--mark", str(RELAY_MARK),
    ]  # fmt: skip
    return Service(
        f"delay-relay-{host.name}",
        run_dir,
        in_host(host, argv),
        marker="kbit_core.testbed.delay_relay",
        env=env,
        host=host.address,
        port=port,
        error_type=TestbedError,
    )


def delay_relays(run_dir: Path, nodes: Sequence[Host], options: BedOptions, env: dict[str, str]) -> list[Service]:
    """One delay relay per node when the bed's ``link`` has a delay; none otherwise."""
    shape = LinkShape.parse(options.link) if options.link else None
    if shape is None or shape.delay_s == 0:
        return []
    return [relay_service(run_dir, node, shape, options.delay_relay_port, env) for node in nodes]

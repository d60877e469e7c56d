"""Measuring a link from both of its ends: raw-bytes transfers, Kafka request round trips and UDP datagram counts.

Imported by the shaping tests on the root side, and run inside a namespace as
``python tests/testbed/wire_probe.py MODE ARGS...``; each mode prints one JSON line with what it measured.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

CHUNK = 64 * 1024
_SO_RCVBUFFORCE = 33  # asm-generic/socket.h; not exported by Python's socket module


def sink(listener: socket.socket) -> dict[str, float]:
    """Receive one connection to its end; the rate counts from the first byte, so connecting costs nothing. The peer
    is the address the connection came from (the node's own when its delay relay carried it)."""
    conn, (peer, _) = listener.accept()
    with conn:
        first = conn.recv(CHUNK)
        start, received = time.monotonic(), 0
        while data := conn.recv(CHUNK):
            received += len(data)
        return {"bytes": received, "seconds": time.monotonic() - start, "first": len(first), "peer": peer}


def send(host: str, port: int, nbytes: int) -> None:
    payload = bytes(CHUNK)
    with socket.create_connection((host, port)) as conn:
        for _ in range(nbytes // CHUNK):
            conn.sendall(payload)


def kafka_round_trips(host: str, port: int, count: int) -> list[float]:
    """Seconds per ApiVersions v0 request (a real Kafka request, answered by the broker) on one connection."""
    client_id = b"kbit-shaping-probe"
    times = []
    with socket.create_connection((host, port)) as conn, conn.makefile("rb") as responses:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for correlation in range(count + 1):
            header = struct.pack("!hhih", 18, 0, correlation, len(client_id)) + client_id
            start = time.monotonic()
            conn.sendall(struct.pack("!i", len(header)) + header)
            (size,) = struct.unpack("!i", responses.read(4))  # a buffered read returns all n bytes (short at EOF)
            (answered,) = struct.unpack("!i", responses.read(size)[:4])
            assert answered == correlation, f"response to request {answered}, expected {correlation}"
            times.append(time.monotonic() - start)
    return times[1:]  # the first one also paid for the connection's set-up


def udp_send(host: str, port: int, count: int) -> None:
    """``count`` numbered datagrams, paced so that neither the link's queue nor the receiver's buffer overflows."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for i in range(count):
            sock.sendto(struct.pack("!i", i) + bytes(60), (host, port))
            if i % 100 == 99:
                time.sleep(0.005)


def udp_receiver(address: str, port: int) -> socket.socket:
    """A UDP socket whose buffer holds every datagram of a test, so a busy machine that schedules the receiver late
    loses none: the link's drops are the only ones."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 16 << 20)  # needs root, as shaping does
    sock.bind((address, port))
    return sock


def udp_count(sock: socket.socket, idle_s: float = 1.0) -> int:
    """Datagrams received until none came for ``idle_s``."""
    sock.settimeout(idle_s)
    received = 0
    try:
        while sock.recv(2048):
            received += 1
    except TimeoutError:
        return received
    return received


def _main(mode: str, *args: str) -> None:
    if mode == "send":
        send(args[0], int(args[1]), int(args[2]))
        result: object = "sent"
    elif mode == "sink":
        with socket.create_server((args[0], int(args[1]))) as listener:
            print(json.dumps("ready"), flush=True)
            result = sink(listener)
    elif mode == "kafka":
        result = kafka_round_trips(args[0], int(args[1]), int(args[2]))
    elif mode == "udp-send":
        udp_send(args[0], int(args[1]), int(args[2]))
        result = "sent"
    elif mode == "udp-count":
        with udp_receiver(args[0], int(args[1])) as sock:
            print(json.dumps("ready"), flush=True)
            result = udp_count(sock)
    else:
        raise SystemExit(f"wire_probe: unknown mode {mode!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:])

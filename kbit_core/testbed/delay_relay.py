"""The one-way delay of a shaped link: a transparent TCP relay that holds each direction's bytes for the delay.

nftables redirects every TCP connection crossing the node's link to this relay (kbit_core.testbed.shaping); the
relay reads the connection's original destination (SO_ORIGINAL_DST), waits one round trip (the handshake a real
link would cost), connects there with its own socket mark (so that connection is not redirected again) and
forwards each chunk ``delay`` after it arrived, in each direction. A request therefore answers two delays later
than on the bare link. The kernel has no netem; the relay is the part of the path under kbit's control.
Threads, not asyncio: ``time.sleep`` waits to ~0.1 ms where the event loop rounds its waits up to whole ms.
Run as ``python -m kbit_core.testbed.delay_relay --listen ADDR[,ADDR] --port P --delay-ms D --mark M``.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import struct
import threading
import time

log = logging.getLogger("kbit.delay_relay")
_CHUNK = 256 * 1024
_QUEUED_CHUNKS = 256  # per direction: a slow receiver stops the reading side instead of filling memory
_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
_NICENESS = -10


def original_destination(conn: socket.socket) -> tuple[str, int]:
    """Where the client meant to connect before nftables redirected it here (its own address if not redirected)."""
    raw = conn.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def _read(src: socket.socket, held: queue.Queue[tuple[float, bytes]], delay_s: float) -> None:
    try:
        while data := src.recv(_CHUNK):
            held.put((time.monotonic() + delay_s, data))
    except OSError:
        pass
    held.put((time.monotonic() + delay_s, b""))  # the end of the stream arrives late too


def _write(held: queue.Queue[tuple[float, bytes]], dst: socket.socket) -> None:
    try:
        while True:
            due, data = held.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        pass


def _delayed_pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> list[threading.Thread]:
    held: queue.Queue[tuple[float, bytes]] = queue.Queue(_QUEUED_CHUNKS)
    threads = [
        threading.Thread(target=_read, args=(src, held, delay_s), daemon=True),
        threading.Thread(target=_write, args=(held, dst), daemon=True),
    ]
    for t in threads:
        t.start()
    return threads


def relay(client: socket.socket, target: tuple[str, int], delay_s: float, mark: int) -> None:
    """Connect to ``target`` one round trip later and pass bytes both ways, each ``delay_s`` late; close both."""
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        time.sleep(2 * delay_s)
        upstream.connect(target)
    except OSError as exc:
        log.warning("%s:%d unreachable: %s", *target, exc)
        upstream.close()
        # a reset, not an orderly close: the client sees its connection fail, as the far end's refusal would
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        return
    for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threads = _delayed_pipe(client, upstream, delay_s) + _delayed_pipe(upstream, client, delay_s)
    for t in threads:
        t.join()
    client.close()
    upstream.close()


def _accept(listener: socket.socket, delay_s: float, mark: int) -> None:
    while True:
        client, _ = listener.accept()
        try:
            target = original_destination(client)
        except OSError:  # not redirected, hence not tracked: a connection to the relay itself (a health probe)
            target = listener.getsockname()
        if target == listener.getsockname():
            client.close()
            continue
        threading.Thread(target=relay, args=(client, target, delay_s, mark), daemon=True).start()


def serve(addresses: list[str], port: int, delay_s: float, mark: int) -> None:
    listeners = [socket.create_server((address, port)) for address in addresses]
    log.info("relaying TCP on %s port %d with %.3f ms each way", ",".join(addresses), port, delay_s * 1e3)
    threads = [threading.Thread(target=_accept, args=(ls, delay_s, mark), daemon=True) for ls in listeners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="comma-separated addresses to accept redirected connections on")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, per direction")
    parser.add_argument("--mark", type=int, required=True, help="socket mark of upstream connections (not redirected)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:  # the relay stands for the wire, which waits for no CPU: wake it ahead of the bed's services
        os.setpriority(os.PRIO_PROCESS, 0, _NICENESS)
    except PermissionError:
        log.warning("could not raise the relay's priority (niceness %d); its delays may overshoot more", _NICENESS)
    serve(args.listen.split(","), args.port, args.delay_ms / 1e3, args.mark)


if __name__ == "__main__":
    main()

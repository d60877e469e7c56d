"""The bootstrap servers that accept a connection now, for a client that bootstraps from one of them at random.

kafka-python 3.0.12 bootstraps from one server it picks at random and gives that single connection attempt the whole
bootstrap deadline (``bootstrap_timeout_ms``, 30 s). A broker whose packets are dropped (cut off by a firewall, its
host gone) neither accepts nor refuses, so a client that picked it failed after 30 s with ``Unable to bootstrap``
although the other brokers answered: one produce in three runs under a cut-off on the test bed
(docs/reliability.md). librdkafka tries the other servers meanwhile and needs none of this.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0  # a broker that has not accepted a TCP connection by then is not the one to bootstrap from


def answering(servers: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """``servers`` (``host:port``) less those that do not accept a TCP connection while the first ones do.

    Every server is dialled at once; the first to accept within ``timeout_s`` end the wait. A single server, or a
    list none of which accepts in time, comes back as it is: then there is nothing to choose, and the client reports
    the failure itself.
    """
    if len(servers) < 2:
        return servers
    accepted = _first_accepting(servers, timeout_s)
    if not accepted:
        return servers
    left_out = [s for s in servers if s not in accepted]
    if left_out:
        log.info("bootstrapping from %s: %s accepted no connection yet", ",".join(accepted), ",".join(left_out))
    return [s for s in servers if s in accepted]


def _first_accepting(servers: list[str], timeout_s: float) -> list[str]:
    """The servers whose connection completed in the first batch of completions within ``timeout_s``."""
    selector = selectors.DefaultSelector()
    try:
        for server in servers:
            sock = _dial(server)
            if sock is not None:
                selector.register(sock, selectors.EVENT_WRITE, (server, sock))
        deadline = time.monotonic() + timeout_s
        accepted: list[str] = []
        while not accepted and selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                server, sock = key.data
                selector.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    accepted.append(server)
                sock.close()
        return accepted
    finally:
        for key in list(selector.get_map().values()):
            key.data[1].close()
        selector.close()


def _dial(server: str) -> socket.socket | None:
    """A non-blocking socket connecting to ``server``; None when the address does not resolve."""
    host, _, port = server.strip().rpartition(":")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
    except (OSError, ValueError):
        return None
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    sock.connect_ex(address)
    return sock

"""The client side of a SCRAM-SHA-256/512 exchange (RFC 5802, as Kafka's SaslAuthenticate carries it), for the
security preflight: a wrong password or an unknown user is then named within a second instead of surfacing as
librdkafka's "Broker transport failure" after the metadata timeout."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable

__all__ = ["ScramRefused", "scram_exchange"]

HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}


class ScramRefused(Exception):
    """The server refused the exchange (wrong password, unknown user) or answered outside the protocol."""


def _escape(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def _fields(message: bytes) -> dict[str, str]:
    return dict(part.split("=", 1) for part in message.decode().split(",") if "=" in part)


def scram_exchange(mechanism: str, username: str, password: str, send: Callable[[bytes], bytes]) -> None:
    """Authenticate through ``send`` (one SASL message out, the server's answer back; it raises ScramRefused when
    the server refuses). Checks the server's signature too."""
    digest = HASHES[mechanism]
    nonce = base64.b64encode(secrets.token_bytes(18)).decode()
    first_bare = f"n={_escape(username)},r={nonce}"
    server_first = send(f"n,,{first_bare}".encode())
    server = _fields(server_first)
    if not server.get("r", "").startswith(nonce) or "s" not in server or "i" not in server:
        raise ScramRefused(f"unexpected SCRAM server-first message {server_first[:80]!r}")
    salted = hashlib.pbkdf2_hmac(digest, password.encode(), base64.b64decode(server["s"]), int(server["i"]))
    client_key = hmac.new(salted, b"Client Key", digest).digest()
    without_proof = f"c=biws,r={server['r']}"
    auth_message = f"{first_bare},{server_first.decode()},{without_proof}".encode()
    signature = hmac.new(hashlib.new(digest, client_key).digest(), auth_message, digest).digest()
    proof = bytes(a ^ b for a, b in zip(client_key, signature))
    server_final = _fields(send(f"{without_proof},p={base64.b64encode(proof).decode()}".encode()))
    server_key = hmac.new(salted, b"Server Key", digest).digest()
    expected = base64.b64encode(hmac.new(server_key, auth_message, digest).digest()).decode()
    if "e" in server_final or not hmac.compare_digest(server_final.get("v", ""), expected):
        raise ScramRefused(f"the server's SCRAM answer does not verify ({server_final.get('e', 'bad signature')})")

"""Translate the typed Kafka config into each client library's connection options, and mask secrets for logs.

Before a secured connection's options are handed out, the certificate files are checked and one
connection (TLS handshake, ApiVersions, SASL mechanism handshake) is made to the broker, once per process
and setting: a wrong CA, a missing or mismatched certificate, a refused client certificate or a mechanism
the broker lacks then fails within seconds with the setting named, instead of as a generic transport
error after the client's request timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kbit_core.config import KafkaConfig, is_secret_option, mask_credentials
from kbit_core.errors import BrokerError, ConfigError
from kbit_core.kafka.bootstrap import answering
from kbit_core.kafka.scram import HASHES, ScramRefused, scram_exchange

TLS_CHECK_TIMEOUT_S = 10.0
_checked: set[tuple[Any, ...]] = set()
_checked_lock = threading.Lock()


def mask(options: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of ``options`` (nested ones too) with every credential replaced by '***': the value of a credential-like
    option, and the credentials inside any other text value (JAAS/OAuth config strings, URLs)."""
    return {k: _masked(k, v) for k, v in options.items()}


def _masked(option: str, value: Any) -> Any:
    if is_secret_option(option) and value not in (None, ""):
        return "***"
    if isinstance(value, str):
        return mask_credentials(value)
    if isinstance(value, Mapping):
        return mask(value)
    if isinstance(value, list | tuple):
        return [_masked(option, item) for item in value]
    return value


def _tls_files(cfg: KafkaConfig) -> dict[str, Path]:
    files = {name: getattr(cfg, name) for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")}
    return {name: Path(path) for name, path in files.items() if path is not None}


@contextlib.contextmanager
def _memory_file(text: str) -> Iterator[str]:
    """A path to ``text`` that never touches a disk (Linux memfd): for PEM keys given inline in kafka.extra."""
    fd = os.memfd_create("kbit-pem")
    try:
        os.write(fd, text.encode())
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _tls_context(cfg: KafkaConfig) -> ssl.SSLContext:
    """The client's TLS trust and identity, from the ssl_* files or the librdkafka PEM options in kafka.extra."""
    files = _tls_files(cfg)
    for name, path in files.items():
        if not path.is_file():
            raise ConfigError(f"kafka.{name}: {path} does not exist or is not a file")
    if ("ssl_certfile" in files) != ("ssl_keyfile" in files):
        raise ConfigError("kafka.ssl_certfile and kafka.ssl_keyfile go together (a client certificate and its key)")
    pem = {
        k: str(v) for k, v in cfg.client_extra().items() if k in ("ssl.ca.pem", "ssl.certificate.pem", "ssl.key.pem")
    }
    ctx = ssl.create_default_context()
    try:
        if "ssl_cafile" in files:
            ctx.load_verify_locations(cafile=str(files["ssl_cafile"]))
        if "ssl.ca.pem" in pem:
            ctx.load_verify_locations(cadata=pem["ssl.ca.pem"])
    except ssl.SSLError as exc:
        where = f"kafka.ssl_cafile ({files['ssl_cafile']})" if "ssl_cafile" in files else "kafka.extra['ssl.ca.pem']"
        raise ConfigError(f"{where} holds no PEM CA certificate ({exc.reason})") from None
    try:
        if "ssl_certfile" in files:
            where = f"kafka.ssl_keyfile ({files['ssl_keyfile']}) and kafka.ssl_certfile ({files['ssl_certfile']})"
            ctx.load_cert_chain(str(files["ssl_certfile"]), str(files["ssl_keyfile"]))
        elif "ssl.certificate.pem" in pem and "ssl.key.pem" in pem:
            where = "kafka.extra['ssl.key.pem'] and kafka.extra['ssl.certificate.pem']"
            with _memory_file(pem["ssl.certificate.pem"]) as cert, _memory_file(pem["ssl.key.pem"]) as key:
                ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"{where} are not a PEM certificate and its key ({exc.reason})") from None
    return ctx


class _Closed(Exception):
    """The broker closed the connection instead of answering."""


def _request(conn: socket.socket, api_key: int, version: int, payload: bytes = b"") -> bytes:
    """Send one Kafka request (header v1, correlation id 1); return the response after its correlation id."""
    client_id = b"kbit-preflight"
    body = struct.pack(">hhih", api_key, version, 1, len(client_id)) + client_id + payload
    conn.sendall(struct.pack(">i", len(body)) + body)
    head = _read_exactly(conn, 4)
    return _read_exactly(conn, struct.unpack(">i", head)[0])[4:]


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise _Closed
        data += chunk
    return data


def _check_sasl_mechanism(conn: socket.socket, cfg: KafkaConfig, address: str) -> None:
    mechanism = (cfg.sasl_mechanism or "").encode()
    try:
        resp = _request(conn, 17, 1, struct.pack(">h", len(mechanism)) + mechanism)  # SaslHandshake v1
    except _Closed:
        raise BrokerError(
            f"the broker at {address} closed the connection on the SASL handshake: it does not "
            f"authenticate with SASL (kafka.security_protocol={cfg.security_protocol}, "
            f"kafka.sasl_mechanism={cfg.sasl_mechanism})"
        ) from None
    error_code, count = struct.unpack(">hi", resp[:6])
    offered, pos = [], 6
    for _ in range(max(count, 0)):
        (size,) = struct.unpack(">h", resp[pos : pos + 2])
        offered.append(resp[pos + 2 : pos + 2 + size].decode(errors="replace"))
        pos += 2 + size
    if error_code != 0:
        # Tansu without --authentication refuses every mechanism and "offers" the one asked for.
        raise BrokerError(
            f"the broker at {address} refuses kafka.sasl_mechanism={cfg.sasl_mechanism} (Kafka error "
            f"{error_code}; mechanisms it reports: {', '.join(offered) or 'none'}): SASL is not enabled "
            f"there, or not with this mechanism; check kafka.security_protocol and kafka.sasl_mechanism"
        )
    if cfg.sasl_mechanism in HASHES:
        _check_scram(conn, cfg, address)


def _sasl_authenticate(conn: socket.socket, message: bytes) -> bytes:
    """One SaslAuthenticate v0 round trip: ``message`` out, the server's bytes back (ScramRefused on its error)."""
    resp = _request(conn, 36, 0, struct.pack(">i", len(message)) + message)
    error_code, text_len = struct.unpack(">hh", resp[:4])
    pos = 4 + max(text_len, 0)
    if error_code != 0:
        raise ScramRefused(resp[4:pos].decode(errors="replace") if text_len > 0 else f"Kafka error {error_code}")
    (size,) = struct.unpack(">i", resp[pos : pos + 4])
    return resp[pos + 4 : pos + 4 + max(size, 0)]


def _check_scram(conn: socket.socket, cfg: KafkaConfig, address: str) -> None:
    try:
        scram_exchange(
            cfg.sasl_mechanism or "", cfg.sasl_username or "", cfg.sasl_secret(), lambda m: _sasl_authenticate(conn, m)
        )
    except (ScramRefused, _Closed) as exc:
        raise BrokerError(
            f"the broker at {address} refuses {cfg.sasl_mechanism} authentication as "
            f"kafka.sasl_username={cfg.sasl_username}: {exc or 'it closed the connection'}; check "
            "kafka.sasl_password (or kafka.sasl_password_file) and that the user exists"
        ) from None


def _tls_error(exc: ssl.SSLError, address: str, cfg: KafkaConfig) -> BrokerError:
    """What a failed TLS handshake with the broker at ``address`` says about the settings, naming them."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        ca = (
            f"kafka.ssl_cafile ({cfg.ssl_cafile})" if cfg.ssl_cafile else "the system CA store (kafka.ssl_cafile unset)"
        )
        return BrokerError(
            f"the certificate of the broker at {address} does not verify against {ca}: {exc.verify_message}"
        )
    text = str(exc).upper()
    if "CERTIFICATE_REQUIRED" in text:
        return BrokerError(
            f"the broker at {address} requires a client certificate: set kafka.ssl_certfile and kafka.ssl_keyfile"
        )
    # Apache Kafka's JSSE answers a client certificate it cannot verify with certificate_unknown
    if "UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text or "CERTIFICATE_UNKNOWN" in text:
        return BrokerError(
            f"the broker at {address} does not accept the client certificate in "
            f"kafka.ssl_certfile ({cfg.ssl_certfile}): {exc.reason}"
        )
    return BrokerError(
        f"TLS with the broker at {address} failed ({exc.reason}); check "
        f"kafka.security_protocol={cfg.security_protocol} and kafka.ssl_*"
    )


def check_security(cfg: KafkaConfig, timeout_s: float | None = None) -> None:
    """Prove TLS files, certificates and the SASL mechanism against the first reachable bootstrap broker.

    Raises naming the setting at fault; checked once per process and setting. A broker that cannot be
    reached at all is left to the client (it has its own retries and errors). A SCRAM user and password are
    proven by one SCRAM exchange.
    """
    if cfg.security_protocol == "PLAINTEXT":
        return
    files = _tls_files(cfg)
    key = (
        cfg.resolved_bootstrap(),
        cfg.security_protocol,
        cfg.sasl_mechanism,
        (cfg.sasl_username, hash(cfg.sasl_secret())),
        *((n, str(p), p.stat().st_mtime) for n, p in files.items() if p.is_file()),
        *((k, hash(str(v))) for k, v in sorted(cfg.client_extra().items()) if k.startswith("ssl.")),
    )
    if key in _checked:
        return
    ctx = _tls_context(cfg) if cfg.security_protocol.endswith("SSL") else None
    timeout_s = min(cfg.request_timeout_s, TLS_CHECK_TIMEOUT_S) if timeout_s is None else timeout_s
    for address in cfg.resolved_bootstrap().split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            raw = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError:
            continue
        try:
            with ctx.wrap_socket(raw, server_hostname=host) if ctx else raw as conn:
                try:
                    _request(conn, 18, 0)  # ApiVersions v0: any Kafka broker answers it before authentication
                except _Closed:
                    # A TLS 1.3 server verifies the client's certificate after the handshake and may just close.
                    if not ctx:
                        hint = f"check kafka.security_protocol={cfg.security_protocol}"
                    elif cfg.ssl_certfile is None and "ssl.key.pem" not in cfg.extra:
                        hint = "it may require a client certificate: set kafka.ssl_certfile and kafka.ssl_keyfile"
                    else:
                        hint = (
                            "it may not accept the client certificate (kafka.ssl_certfile or "
                            "kafka.extra['ssl.certificate.pem']): is it issued by the broker's CA?"
                        )
                    raise BrokerError(
                        f"the broker at {address} closed the connection without answering; {hint}"
                    ) from None
                if cfg.sasl_mechanism:
                    _check_sasl_mechanism(conn, cfg, address)
        except ssl.SSLError as exc:
            raise _tls_error(exc, address, cfg) from None
        except TimeoutError:
            raise BrokerError(
                f"no answer from the broker at {address} within {timeout_s:.0f}s; check "
                f"kafka.security_protocol={cfg.security_protocol} (a TLS listener?)"
            ) from None
        except OSError:
            continue
        with _checked_lock:
            _checked.add(key)
        return


def confluent_options(cfg: KafkaConfig) -> dict[str, Any]:
    """librdkafka connection options (bootstrap, security) shared by producer, consumer and admin."""
    check_security(cfg)
    opts: dict[str, Any] = {
        "bootstrap.servers": cfg.resolved_bootstrap(),
        "security.protocol": cfg.security_protocol.lower(),
        "socket.timeout.ms": int(cfg.request_timeout_s * 1000),
    }
    if cfg.sasl_mechanism:
        opts["sasl.mechanism"] = cfg.sasl_mechanism
        opts["sasl.username"] = cfg.sasl_username
        opts["sasl.password"] = cfg.sasl_secret()
    if cfg.ssl_cafile:
        opts["ssl.ca.location"] = str(cfg.ssl_cafile)
    if cfg.ssl_certfile:
        opts["ssl.certificate.location"] = str(cfg.ssl_certfile)
    if cfg.ssl_keyfile:
        opts["ssl.key.location"] = str(cfg.ssl_keyfile)
    opts.update(cfg.client_extra())
    return opts


def kafka_python_options(cfg: KafkaConfig) -> dict[str, Any]:
    """kafka-python connection keyword arguments equivalent to :func:`confluent_options`; the bootstrap servers are
    those that accept a connection now (:func:`kbit_core.kafka.bootstrap.answering`: kafka-python bootstraps from one
    it picks at random)."""
    check_security(cfg)
    opts: dict[str, Any] = {
        "bootstrap_servers": answering(cfg.resolved_bootstrap().split(",")),
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": int(cfg.request_timeout_s * 1000) + 1000,
    }
    if cfg.sasl_mechanism:
        opts["sasl_mechanism"] = cfg.sasl_mechanism
        opts["sasl_plain_username"] = cfg.sasl_username
        opts["sasl_plain_password"] = cfg.sasl_secret()
    if cfg.ssl_cafile:
        opts["ssl_cafile"] = str(cfg.ssl_cafile)
    if cfg.ssl_certfile:
        opts["ssl_certfile"] = str(cfg.ssl_certfile)
    if cfg.ssl_keyfile:
        opts["ssl_keyfile"] = str(cfg.ssl_keyfile)
    return opts

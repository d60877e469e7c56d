"""A blocking connection to one broker for kbit's own Metadata and Fetch requests: TLS and SASL set up as the
configuration says, requests encoded and responses decoded by kafka-python's protocol classes, and each response
read whole into one buffer (kafka-python's own connection reads 4 KiB a call: ~3 µs of CPU per 800-byte record)."""

from __future__ import annotations

import socket
import ssl
import struct
from typing import Any

import kafka.errors
from kafka.net.sasl import get_sasl_mechanism
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from kbit_core.errors import BrokerError

CLIENT_ID = "kbit-fetch"
_SIZE = struct.Struct(">i")
MAX_FRAME = 1 << 30


class FetchConnection:
    """One broker, one request at a time. ``options`` are :func:`kbit_core.kafka.settings.kafka_python_options`'
    (security protocol, SASL credentials, TLS files, request timeout)."""

    def __init__(self, host: str, port: int, options: dict[str, Any]) -> None:
        self.address = f"{host}:{port}"
        self._correlation = 0
        self._buffer = bytearray()
        timeout_s = options["request_timeout_ms"] / 1000
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if options["security_protocol"] in ("SSL", "SASL_SSL"):
                sock = _tls_context(options).wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            raise BrokerError(f"cannot connect to broker {self.address}: {exc}") from None
        self._sock = sock
        try:
            self.versions = self._api_versions()
            if options["security_protocol"].startswith("SASL_"):
                self._authenticate(host, options)
        except BaseException:
            self.close()
            raise

    def version(self, request_class: Any, highest: int) -> int:
        """The highest version of ``request_class`` both kbit (``highest``) and the broker speak."""
        low, high = self.versions.get(request_class.API_KEY, (0, -1))
        chosen = min(high, highest)
        if chosen < low:
            raise BrokerError(
                f"broker {self.address} speaks {request_class.__name__} v{low}-v{high}, kbit up to v{highest}"
            )
        return chosen

    def request(self, request: Any, response_class: Any, version: int) -> Any:
        """Send ``request`` at ``version`` and return its decoded response."""
        return self.receive(response_class, version, self.send(request, version))

    def send(self, request: Any, version: int) -> int:
        """Send ``request`` without waiting for its answer (:meth:`receive` reads it); returns its correlation id."""
        self._correlation += 1
        request.with_header(correlation_id=self._correlation, client_id=CLIENT_ID)
        try:
            self._sock.sendall(request.encode(version=version, header=True, framed=True))
        except (OSError, ssl.SSLError) as exc:
            raise BrokerError(f"cannot send {type(request).__name__} to broker {self.address}: {exc}") from None
        return self._correlation

    def receive(self, response_class: Any, version: int, correlation: int) -> Any:
        """The response to the request sent as ``correlation`` (the next one on the connection)."""
        try:
            frame = self._read_frame()
        except (OSError, ssl.SSLError) as exc:
            raise BrokerError(f"broker {self.address} did not answer {response_class.__name__}: {exc}") from None
        (answered,) = _SIZE.unpack_from(frame)
        if answered != correlation:
            raise BrokerError(f"broker {self.address} answered request {answered}, not {correlation}")
        # The header is read here: kafka-python's decode copies the whole frame to read it. A flexible response
        # header ends with its tagged fields, of which brokers send none (a count of 0).
        body = _SIZE.size
        if response_class.flexible_version_q(version) and response_class is not ApiVersionsResponse:
            if frame[body]:
                return response_class.decode(frame, version=version, header=True)
            body += 1
        return response_class.decode(frame[body:], version=version)

    def _read_frame(self) -> memoryview:
        """The next response, in a receive buffer reused from one response to the next (a fresh one per response
        was zero-filled and faulted in page by page): valid until the next request."""
        (size,) = _SIZE.unpack(self._read_into(_SIZE.size))
        if not 0 < size <= MAX_FRAME:
            raise BrokerError(f"broker {self.address} sent a response of {size} bytes")
        return self._read_into(size)

    def _read_into(self, size: int) -> memoryview:
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view, got = memoryview(self._buffer)[:size], 0
        while got < size:
            n = self._sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("connection closed by the broker")
            got += n
        return view

    def _api_versions(self) -> dict[int, tuple[int, int]]:
        response = self.request(ApiVersionsRequest(), ApiVersionsResponse, 0)
        if response.error_code:
            raise BrokerError(
                f"broker {self.address}: ApiVersions failed: {kafka.errors.for_code(response.error_code).__name__}"
            )
        return {api.api_key: (api.min_version, api.max_version) for api in response.api_keys}

    def _authenticate(self, host: str, options: dict[str, Any]) -> None:
        name = options["sasl_mechanism"]
        handshake = self.request(SaslHandshakeRequest(mechanism=name), SaslHandshakeResponse, 1)
        if handshake.error_code:
            raise BrokerError(f"broker {self.address} refused SASL mechanism {name}; it offers {handshake.mechanisms}")
        mechanism = get_sasl_mechanism(name)(host=host, **options)
        while not mechanism.is_done():
            answer = self.request(
                SaslAuthenticateRequest(auth_bytes=mechanism.auth_bytes()), SaslAuthenticateResponse, 1
            )
            if answer.error_code:
                # the broker's message names the mechanism's failure; never the credentials
                raise BrokerError(f"SASL {name} authentication to broker {self.address} failed: {answer.error_message}")
            mechanism.receive(answer.auth_bytes)
        if not mechanism.is_authenticated():
            raise BrokerError(f"SASL {name} authentication to broker {self.address} failed")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def _tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if options.get("ssl_cafile"):
        context.load_verify_locations(options["ssl_cafile"])
    else:
        context.load_default_certs()
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return context

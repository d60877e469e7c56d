"""TLS in front of the embedded broker: accept TLS (optionally requiring a client certificate), relay to Tansu.

Tansu 0.6.0 cannot terminate TLS itself: its `--cert` and `--key` flags are mutually exclusive
(clap rejects the pair) and either one alone leaves the listener plaintext. Run as
`python -m kbit_core.testbed.tls_front --listen HOST:PORT --upstream HOST:PORT --cert C --key K [--client-ca CA]`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl

log = logging.getLogger("kbit.tls_front")
_CHUNK = 1 << 20


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def serve(listen: str, upstream: str, ctx: ssl.SSLContext) -> None:
    up_host, up_port = _split(upstream)

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            broker_r, broker_w = await asyncio.open_connection(up_host, up_port)
        except OSError as exc:
            log.error("broker %s unreachable: %s", upstream, exc)
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, broker_w), _pipe(broker_r, client_w))

    host, port = _split(listen)
    server = await asyncio.start_server(relay, host, port, ssl=ctx, ssl_handshake_timeout=10)
    log.info("TLS on %s -> %s", listen, upstream)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--client-ca", help="require client certificates signed by this CA (mutual TLS)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.upstream, server_context(args.cert, args.key, args.client_ca)))


if __name__ == "__main__":
    main()

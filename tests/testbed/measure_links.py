"""The figures of docs/network.md: configured against measured rate, round trip and loss on the tests' own veth
pair (kbs-*), with the probes and helpers of test_shaping.py.

Run as root: ``python -m tests.testbed.measure_links [--broker HOST:PORT]`` (a broker on loopback, for the Kafka
round trips); prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kbit_core.testbed.shaping import LinkShape
from tests.conftest import free_port
from tests.testbed.test_shaping import (
    FRAME_PAYLOAD,
    datagrams_received,
    delay_link,
    forward,
    kafka_round_trip,
    transfer,
    veth_link,
)

RATES = ("10mbit", "100mbit", "1gbit")
LOSSES = ("0.1%", "1%", "5%")
DELAYS = ("20ms", "5ms", "2ms", "0.5ms")
DATAGRAMS = 20_000


def _rates() -> None:
    for spec in RATES:
        shape = LinkShape.parse(spec)
        nbytes = max(shape.rate_bit_s // 8 * 2, 4 << 20)  # about 2 s at the rate
        for towards in (True, False):
            with veth_link() as link:
                link.shape(shape)
                got = transfer(towards, nbytes, free_port())
            goodput = got["bytes"] * 8 / got["seconds"]
            print(
                json.dumps(
                    {
                        "link": spec,
                        "towards_node": towards,
                        "goodput_bit_s": round(goodput),
                        "ratio_to_rate_x_frame_payload": round(goodput / shape.rate_bit_s / FRAME_PAYLOAD, 3),
                    }
                )
            )


def _losses() -> None:
    for spec in LOSSES:
        shape = LinkShape.parse(f"1gbit,0ms,{spec}")
        for towards in (True, False):
            with veth_link() as link:
                link.shape(shape)
                received = datagrams_received(towards, DATAGRAMS, free_port())
            print(
                json.dumps(
                    {
                        "link": shape.spec(),
                        "towards_node": towards,
                        "sent": DATAGRAMS,
                        "lost": DATAGRAMS - received,
                        "loss": (DATAGRAMS - received) / DATAGRAMS,
                    }
                )
            )


def _round_trips(broker: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, veth_link() as link, forward(broker) as forwarder:
        port = forwarder.getsockname()[1]
        bare = kafka_round_trip(port)
        print(json.dumps({"link": "unshaped", "round_trip_ms": round(bare * 1e3, 2)}))
        for spec in DELAYS:
            shape = LinkShape.parse(f"1gbit,{spec}")
            relay_service = delay_link(link, shape, Path(tmp))
            try:
                shaped = kafka_round_trip(port)
            finally:
                relay_service.stop()
            print(
                json.dumps(
                    {
                        "link": shape.spec(),
                        "round_trip_ms": round(shaped * 1e3, 2),
                        "added_ms": round((shaped - bare) * 1e3, 2),
                        "twice_delay_ms": 2 * shape.delay_s * 1e3,
                    }
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", help="HOST:PORT of a Kafka broker on loopback, for the round trips")
    parser.add_argument("--no-rates", dest="rates", action="store_false", help="only the round trips")
    args = parser.parse_args()
    if args.rates:
        _rates()
        _losses()
    if args.broker:
        _round_trips(args.broker)


if __name__ == "__main__":
    main()

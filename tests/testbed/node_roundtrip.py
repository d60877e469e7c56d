"""Run on a test-bed host: produce a small dataset with one client over the configured (TLS) connection, read it back
with both clients and with kbit's own Fetch requests, delete the topic, and print one JSON line: hostname, records produced and read per client.

usage: python node_roundtrip.py PRODUCE_CLIENT WORKDIR KEY=VALUE...   (dotted kbit config overrides)
"""

from __future__ import annotations

import json
import socket
import sys

from kbit_core.config import load_config
from kbit_core.data.reader import RangeReader
from kbit_core.formats import get_codec
from kbit_core.kafka import admin
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange


def main(produce_client: str, workdir: str, *overrides: str) -> None:
    cfg = load_config(
        None,
        [
            f"workdir={workdir}",
            "dataset.num_records=64",
            "produce.partitions=2",
            f"produce.client={produce_client}",
            f"kafka.client={produce_client}",
            f"produce.topic_prefix=kbit-bed-{socket.gethostname()}-{produce_client}",
            *overrides,
        ],
    )
    manifest = produce_dataset(cfg, progress=False, recreate=True)
    v = manifest.variant
    codec = get_codec(v.format, v.layout, manifest.dataset.image_shape, v.records_per_message)
    ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    read = {}
    # each client's consumer, and kbit's own Fetch requests (reader.fetch: batches: TLS and SCRAM set up by kbit)
    for name, client, fetch in (
        ("confluent", "confluent", "messages"),
        ("kafka-python", "kafka-python", "messages"),
        ("batches", "confluent", "batches"),
    ):
        fetch_cfg = cfg.override({"reader.fetch": fetch})
        with RangeReader(fetch_cfg.kafka, fetch_cfg.reader, manifest.topic, codec, client) as reader:
            read[name] = sum(len(batch.labels) for _, batch in reader.read(ranges))
    admin.delete_topic(cfg.kafka, manifest.topic)
    print(json.dumps({"hostname": socket.gethostname(), "produced": manifest.num_records, "read": read}))


if __name__ == "__main__":
    main(*sys.argv[1:])

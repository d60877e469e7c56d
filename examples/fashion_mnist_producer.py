"""An example producer that is not kbit: it writes Fashion-MNIST into a Kafka topic as a user's own service would,
with confluent-kafka alone and its ``AvroSerializer`` against a Schema Registry, in an Avro schema of its own
(kbit then trains on the topic through a mapping: deployments/train-fashion-mnist.yaml).

Each value is a ``example.wardrobe.ProductPhoto`` (:data:`SCHEMA`, registered under ``<topic>-value``):
``{"photo": {"grey": <784 bytes>, "width": 28, "height": 28}, "category": <name>, "subset": "train" | "test"}``,
keyed ``<subset>-<n>``. Record times mark the periods a split by time reads: the first 55,000 training images at
2024-01-01, the last 5,000 at 2024-01-02 (validation), the 10,000 test images at 2024-01-03.

The images: Debian's package ``dataset-fashion-mnist`` (Expat licence), unpacked without root:
``apt-get download dataset-fashion-mnist && dpkg -x dataset-fashion-mnist_*.deb fmnist`` gives
``fmnist/usr/share/datasets/fashion-mnist``.

    python examples/fashion_mnist_producer.py --data fmnist/usr/share/datasets/fashion-mnist \\
        --bootstrap 127.0.0.1:19092 --registry http://127.0.0.1:18081/apis/ccompat/v7 --topic fashion-mnist.images
"""

from __future__ import annotations

import argparse
import gzip
import json
import struct
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

CATEGORIES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
VALIDATION_IMAGES = 5_000
START = datetime(2024, 1, 1, tzinfo=UTC)
SCHEMA = {
    "type": "record",
    "name": "ProductPhoto",
    "namespace": "example.wardrobe",
    "fields": [
        {
            "name": "photo",
            "type": {
                "type": "record",
                "name": "Photo",
                "fields": [
                    {"name": "grey", "type": "bytes", "doc": "grey levels, row by row, 0 = white"},
                    {"name": "width", "type": "int"},
                    {"name": "height", "type": "int"},
                ],
            },
        },
        {"name": "category", "type": "string"},
        {"name": "subset", "type": "string"},
    ],
}


class Photo(NamedTuple):
    """One image to write: its grey levels, class, subset and record time."""

    grey: bytes
    label: int
    subset: str
    timestamp_ms: int


def read_idx(path: Path) -> tuple[tuple[int, ...], bytes]:
    """An IDX file's dimensions and its unsigned bytes."""
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise SystemExit(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{dims}I", data[4 : 4 + 4 * dims])
    return shape, data[4 + 4 * dims :]


def images(directory: Path, prefix: str) -> list[tuple[bytes, int]]:
    """The (pixels, label) pairs of one IDX image file and its label file."""
    (count, height, width), pixels = read_idx(directory / f"{prefix}-images-idx3-ubyte.gz")
    (labels_count,), labels = read_idx(directory / f"{prefix}-labels-idx1-ubyte.gz")
    if labels_count != count:
        raise SystemExit(f"{directory}: {count} {prefix} images but {labels_count} labels")
    size = height * width
    return [(pixels[i * size : (i + 1) * size], labels[i]) for i in range(count)]


def fashion_mnist(directory: Path) -> Iterator[Photo]:
    """Every image in the order written: training (two periods, a day apart), then test."""
    train = images(directory, "train")
    periods = [
        ("train", train[:-VALIDATION_IMAGES], START),
        ("train", train[-VALIDATION_IMAGES:], START + timedelta(days=1)),
        ("test", images(directory, "t10k"), START + timedelta(days=2)),
    ]
    for subset, pairs, start in periods:
        start_ms = int(start.timestamp() * 1000)
        for n, (grey, label) in enumerate(pairs):
            yield Photo(grey, label, subset, start_ms + n)


def produce_photos(
    bootstrap: str, registry: str, topic: str, photos: Iterable[Photo], *, partitions: int = 2, rate: float = 0
) -> int:
    """Write ``photos`` to ``topic`` (created with ``partitions`` if missing), round robin over the partitions,
    ``rate`` records a second at most (0: as fast as the broker takes them); the number written."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic not in admin.list_topics(timeout=10).topics:
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
    serializer = AvroSerializer(SchemaRegistryClient({"url": registry, "timeout": 30}), json.dumps(SCHEMA))
    context = SerializationContext(topic, MessageField.VALUE)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    began, sent = time.monotonic(), 0
    for photo in photos:
        value = {
            "photo": {"grey": photo.grey, "width": 28, "height": 28},
            "category": CATEGORIES[photo.label],
            "subset": photo.subset,
        }
        key = f"{photo.subset}-{sent}".encode()
        producer.produce(
            topic, serializer(value, context), key, partition=sent % partitions, timestamp=photo.timestamp_ms
        )
        sent += 1
        producer.poll(0)
        ahead_s = sent / rate - (time.monotonic() - began) if rate else 0.0
        if ahead_s > 0:
            time.sleep(ahead_s)
    left = producer.flush(60)
    if left:
        raise SystemExit(f"{left} records were not delivered")
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="directory holding the four IDX .gz files")
    parser.add_argument("--bootstrap", default="127.0.0.1:19092")
    parser.add_argument("--registry", default="http://127.0.0.1:18081/apis/ccompat/v7", help="Schema Registry URL")
    parser.add_argument("--topic", default="fashion-mnist.images")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0, help="records a second at most (0: no limit)")
    args = parser.parse_args()
    photos = fashion_mnist(args.data)
    sent = produce_photos(args.bootstrap, args.registry, args.topic, photos, partitions=args.partitions, rate=args.rate)
    print(f"wrote {sent} records to {args.topic}")


if __name__ == "__main__":
    main()

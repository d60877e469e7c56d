"""An example producer that is not kbit: it writes Fashion-MNIST into a Kafka topic with confluent-kafka alone, as a
user's own service would, in JSON of its own field names (kbit then trains on the topic through a mapping:
deployments/train-fashion-mnist.yaml).

Each value is ``{"image": {"pixels": <base64 of 784 uint8>, "width": 28, "height": 28}, "category": <name>,
"set": "train" | "test"}``, keyed ``<set>-<n>``. Record times mark the periods a split by time reads: the first
55,000 training images at 2024-01-01, the last 5,000 at 2024-01-02 (validation), the 10,000 test images at
2024-01-03.

The images: Debian's package ``dataset-fashion-mnist`` (Expat licence), unpacked without root:
``apt-get download dataset-fashion-mnist && dpkg -x dataset-fashion-mnist_*.deb fmnist`` gives
``fmnist/usr/share/datasets/fashion-mnist``.

    python examples/fashion_mnist_producer.py --data fmnist/usr/share/datasets/fashion-mnist \\
        --bootstrap 127.0.0.1:19092 --topic fashion-mnist.images
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import struct
from datetime import UTC, datetime, timedelta
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

CATEGORIES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
VALIDATION_IMAGES = 5_000
START = datetime(2024, 1, 1, tzinfo=UTC)


def read_idx(path: Path) -> tuple[tuple[int, ...], bytes]:
    """An IDX file's dimensions and its unsigned bytes."""
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise SystemExit(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{dims}I", data[4 : 4 + 4 * dims])
    return shape, data[4 + 4 * dims :]


def records(directory: Path, prefix: str) -> list[tuple[bytes, int]]:
    (count, height, width), pixels = read_idx(directory / f"{prefix}-images-idx3-ubyte.gz")
    (labels_count,), labels = read_idx(directory / f"{prefix}-labels-idx1-ubyte.gz")
    assert labels_count == count, (labels_count, count)
    size = height * width
    return [(pixels[i * size : (i + 1) * size], labels[i]) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="directory holding the four IDX .gz files")
    parser.add_argument("--bootstrap", default="127.0.0.1:19092")
    parser.add_argument("--topic", default="fashion-mnist.images")
    parser.add_argument("--partitions", type=int, default=2)
    args = parser.parse_args()
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    if args.topic not in admin.list_topics(timeout=10).topics:
        admin.create_topics([NewTopic(args.topic, args.partitions, 1)])[args.topic].result(30)
    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    train = records(args.data, "train")
    periods = [
        ("train", train[:-VALIDATION_IMAGES], START),
        ("train", train[-VALIDATION_IMAGES:], START + timedelta(days=1)),
        ("test", records(args.data, "t10k"), START + timedelta(days=2)),
    ]
    sent = 0
    for subset, images, start in periods:
        start_ms = int(start.timestamp() * 1000)
        for n, (pixels, label) in enumerate(images):
            value = {
                "image": {"pixels": base64.b64encode(pixels).decode("ascii"), "width": 28, "height": 28},
                "category": CATEGORIES[label],
                "set": subset,
            }
            producer.produce(
                args.topic,
                json.dumps(value).encode(),
                f"{subset}-{sent}".encode(),
                partition=sent % args.partitions,
                timestamp=start_ms + n,
            )
            sent += 1
            producer.poll(0)
    left = producer.flush(60)
    if left:
        raise SystemExit(f"{left} records were not delivered")
    print(f"wrote {sent} records to {args.topic}")


if __name__ == "__main__":
    main()

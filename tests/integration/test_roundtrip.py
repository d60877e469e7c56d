"""Every format × layout × compression, produced into the real broker and read back with both clients, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kbit_core.config import COMPRESSIONS, FORMATS
from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.sharding import OffsetRange
from tests.integration.dataplane_fixtures import Produce, source_truth

pytestmark = [pytest.mark.kafka, pytest.mark.both_brokers]

NUM_RECORDS = 30
VARIANTS = [(fmt, layout) for fmt in FORMATS for layout in ("list", "bytes") if not (fmt == "raw" and layout == "list")]


def read_everything(cfg, manifest, client):
    """Decoded batches of every manifest range, concatenated in offset order, and the reader's stats."""
    from kbit_core.formats import get_codec

    v = manifest.variant
    codec = get_codec(v.format, v.layout, manifest.dataset.image_shape, v.records_per_message)
    ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, client) as reader:
        batches = [batch for _, batch in reader.read(ranges)]
    cat = {k: np.concatenate([getattr(b, k) for b in batches]) for k in ("indices", "labels", "pixels")}
    return cat, reader.stats


def assert_matches_source(cfg, decoded, layout):
    images, labels = source_truth(cfg)
    order = np.argsort(decoded["indices"])
    assert decoded["indices"][order].tolist() == list(range(len(labels))), "every sample exactly once"
    assert decoded["labels"][order].tolist() == labels.tolist()
    pixels = decoded["pixels"][order]
    if layout == "bytes":
        assert pixels.dtype == np.uint8 and np.array_equal(pixels, images)
    else:
        assert pixels.dtype == np.float32
        np.testing.assert_allclose(pixels, images.astype(np.float32) / 255, atol=1e-6)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize(("fmt", "layout"), VARIANTS, ids=[f"{f}-{lay}" for f, lay in VARIANTS])
def test_variant_round_trips_with_both_clients(produce_topic: Produce, fmt, layout, compression):
    cfg, manifest = produce_topic({"format": fmt, "layout": layout, "compression": compression}, NUM_RECORDS)
    for client in ("confluent", "kafka-python"):
        decoded, stats = read_everything(cfg, manifest, client)
        assert_matches_source(cfg, decoded, layout)
        assert (stats.messages, stats.records, stats.skipped, stats.gaps) == (NUM_RECORDS, NUM_RECORDS, 0, 0)
        assert stats.bytes == manifest.value_bytes


@pytest.mark.parametrize(("fmt", "rpm"), [("json", 4), ("avro", 3), ("protobuf", 7), ("bson", 8), ("raw", 5)])
def test_grouped_messages_round_trip_with_a_short_last_message(produce_topic: Produce, fmt, rpm):
    layout = "list" if fmt == "json" else "bytes"
    cfg, manifest = produce_topic(
        {"format": fmt, "layout": layout, "compression": "zstd", "records_per_message": rpm}, NUM_RECORDS
    )
    assert manifest.num_messages == -(-NUM_RECORDS // rpm)
    decoded, stats = read_everything(cfg, manifest, "confluent")
    assert_matches_source(cfg, decoded, layout)
    assert stats.messages == manifest.num_messages and stats.records == NUM_RECORDS


@pytest.mark.parametrize("mode", ["stream", "eager"])
def test_loader_turns_both_layouts_into_the_same_float_batches(produce_topic: Produce, mode):
    """x is float32 in [0, 1] whatever the pixel layout; uint8 / 255 equals the list layout's floats."""
    batches = {}
    for layout in ("list", "bytes"):
        cfg, manifest = produce_topic(
            {"format": "avro", "layout": layout, "compression": "lz4"},
            48,
            shard__split_rates=[0.5, 0.5],
            reader__mode=mode,
            train__global_batch_size=8,
        )
        with make_split_loader(cfg, manifest, "val", 0, 1) as loader:
            batches[layout] = list(loader.iter_indexed())
            assert len(batches[layout]) == len(loader) == 3
    for lst, byt in zip(batches["list"], batches["bytes"]):
        assert lst.x.dtype == byt.x.dtype == torch.float32 and lst.y.dtype == torch.int64
        assert lst.x.shape == (8, 1, 28, 28)
        assert torch.equal(lst.indices, byt.indices) and torch.equal(lst.y, byt.y)
        assert torch.equal(lst.x, byt.x), "uint8 / 255 gives exactly the list layout's float32 values"
        assert 0.0 <= float(byt.x.min()) and float(byt.x.max()) <= 1.0

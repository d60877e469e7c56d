"""Token sequences through the real broker: produced in raw and protobuf bytes under every compression, read back
bit for bit with the stock and fast decoders, batched as int64 ids, and trained on by 2 ranks streaming them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kbit_core.config import COMPRESSIONS
from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.datasets import open_source
from kbit_core.errors import ConfigError
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange
from tests.integration.dataplane_fixtures import Produce
from tests.integration.test_train_worker import WORLD_SIZE, run_kafka_ranks

pytestmark = [pytest.mark.kafka]

SEQ_LEN = 16
TOKENS = {"dataset__name": "synthetic_tokens", "dataset__seq_len": SEQ_LEN, "dataset__vocab_size": 1000}


def source_ids(cfg) -> tuple[np.ndarray, np.ndarray]:
    _, ids, labels = next(open_source(cfg.dataset).batches(0, None, cfg.dataset.num_records))
    return ids, labels


# every compression for single records; grouped messages (a short last one) under one
CELLS = [(fmt, 1, compression) for fmt in ("raw", "protobuf") for compression in COMPRESSIONS]
CELLS += [("raw", 4, "zstd"), ("protobuf", 7, "lz4")]


@pytest.mark.parametrize(("fmt", "records_per_message", "compression"), CELLS)
def test_token_topic_reads_back_bit_for_bit(produce_topic: Produce, fmt, records_per_message, compression) -> None:
    variant = {"format": fmt, "layout": "bytes", "compression": compression, "records_per_message": records_per_message}
    cfg, manifest = produce_topic(variant, 30, **TOKENS)
    info = manifest.dataset
    assert (info.image_shape, info.record_dtype, info.vocab_size) == ((SEQ_LEN,), "uint16", 1000)
    ids, labels = source_ids(cfg)
    ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    for decoder in ("stock", "fast"):
        with RangeReader(cfg.kafka, cfg.reader, manifest.topic, manifest_codec(manifest, decoder), "confluent") as r:
            batches = [batch for _, batch in r.read(ranges)]
        indices = np.concatenate([b.indices for b in batches])
        order = np.argsort(indices)
        assert indices[order].tolist() == list(range(30)), "every record exactly once"
        pixels = np.concatenate([b.pixels for b in batches])[order]
        assert pixels.dtype == np.uint16 and np.array_equal(pixels, ids), decoder
        assert np.array_equal(np.concatenate([b.labels for b in batches])[order], labels)


@pytest.mark.parametrize(("workers", "decode_processes"), [("thread", 0), ("thread", 1), ("process", 0)])
def test_loader_hands_out_token_ids_as_int64(produce_topic: Produce, workers: str, decode_processes: int) -> None:
    cfg, manifest = produce_topic(
        {"format": "protobuf", "layout": "bytes", "compression": "lz4"},
        48,
        shard__split_rates=[0.5, 0.5],
        train__global_batch_size=8,
        reader__workers=workers,
        reader__decode_processes=decode_processes,
        **TOKENS,
    )
    ids, labels = source_ids(cfg)
    with make_split_loader(cfg, manifest, "val", 0, 1) as loader:
        batches = list(loader.iter_indexed())
    assert len(batches) == 3
    for batch in batches:
        assert batch.x.dtype == torch.int64 and batch.x.shape == (8, SEQ_LEN)
        assert torch.equal(batch.x, torch.from_numpy(ids[batch.indices.numpy()].astype(np.int64)))
        assert torch.equal(batch.y, torch.from_numpy(labels[batch.indices.numpy()]))


def test_a_layout_that_cannot_carry_token_ids_is_refused_before_the_topic_exists(make_config, topic_name) -> None:
    cfg = make_config(
        dataset__num_records=10,
        produce__topic=topic_name,
        produce__variant={"format": "json", "layout": "bytes"},
        **TOKENS,
    )
    with pytest.raises(ConfigError, match="json/bytes carries uint8 pixels only; uint16 records") as caught:
        produce_dataset(cfg, progress=False)
    assert "\n" not in str(caught.value)
    assert not admin.topic_exists(cfg.kafka, topic_name)


@pytest.mark.slow
def test_two_ranks_stream_tokens_and_learn_the_motifs(produce_topic: Produce, tmp_path: Path) -> None:
    cfg, manifest = produce_topic(
        {"format": "raw", "layout": "bytes", "compression": "lz4"},
        1600,
        shard__split_rates=[0.8, 0.2],
        launch__num_processes=WORLD_SIZE,
        tracking__enabled=False,
        train__global_batch_size=32,
        train__epochs=2,
        train__seed=1,
        train__model={"name": "token_transformer", "kwargs": {"vocab_size": 1000, "dim": 32, "heads": 2}},
        train__optim={"name": "adam", "lr": 0.003},
        **TOKENS,
    )
    result = run_kafka_ranks(cfg, manifest, tmp_path / "run")
    assert result["world_size"] == WORLD_SIZE and result["data"]["train"]["skipped_messages"] == 0
    assert result["train_loss"][-1] < result["train_loss"][0] / 2, result["train_loss"]
    assert result["val_accuracy"][-1] >= 0.9, result["val_accuracy"]

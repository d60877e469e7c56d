"""The rank side of continuous training on the real broker: its stream source decodes with ``reader.decoder``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.formats.fast import FastPath
from kbit_core.produce import produce_dataset
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.train import stream_worker
from kbit_core.train.distributed import DistEnv
from kbit_core.train.loop import SplitLoaders
from kbit_core.train.stream_worker import heldout_config, stream_main
from tests.stream.stream_fixtures import stream_config

pytestmark = pytest.mark.kafka

RECORDS = 12


def first_stream_batch(cfg: KbitConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The codec and the first batch of rank 0 of 1, from the loaders ``stream_main`` builds (its training loop is
    left out: it gets the loaders and reads them here)."""
    heldout = produce_dataset(heldout_config(cfg), progress=False)

    def read_first_batch(cfg: KbitConfig, run_dir: str, make_loaders: Any, *_: Any, **__: Any) -> dict[str, Any]:
        env = DistEnv(0, 1, 0, "127.0.0.1", 0, torch.device("cpu"))
        loaders: SplitLoaders = make_loaders(cfg, env)
        source = loaders.train
        source.start_fresh()
        assert source.fill(RECORDS, timeout_s=30) == RECORDS
        batch = source.take(RECORDS)
        source.close()
        return {"codec": source.codec, "batch": batch}

    monkeypatch.setattr(stream_worker, "run_worker", read_first_batch)
    out = stream_main(cfg, heldout.model_dump_json(), str(tmp_path / "run"))
    return out["codec"], out["batch"]


# torch warns when a batch is made of a decoder's read-only buffer (writing to it would be undefined)
@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.parametrize(("decoder", "fast"), [(None, True), ("fast", True), ("stock", False)])
def test_the_stream_decodes_with_the_configured_decoder(
    tmp_path: Path, broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch, decoder: str | None, fast: bool
) -> None:
    """Avro lists, where kbit's fast decoder and the stock library differ most; unset means the default (fast)."""
    reader = {"decoder": decoder} if decoder else {}
    cfg = stream_config(
        tmp_path,
        broker,
        {
            "produce": {"partitions": 1, "variant": {"format": "avro", "layout": "list"}},
            "train": {"mode": "continuous"},
            "stream": {"eval_records": 20},
            "reader": reader,
        },
    )
    LiveProducer(cfg).run(rate=5000, records=RECORDS)
    codec, batch = first_stream_batch(cfg, tmp_path, monkeypatch)
    assert (codec.format, codec.layout) == ("avro", "list")
    assert isinstance(codec, FastPath) is fast
    _, records, labels = next(open_source(cfg.dataset).batches(0, RECORDS))
    assert batch.indices.tolist() == list(range(RECORDS))
    assert np.array_equal(batch.y.numpy(), labels)
    assert np.array_equal(batch.x.numpy(), np.divide(records, np.float32(255), dtype=np.float32))
